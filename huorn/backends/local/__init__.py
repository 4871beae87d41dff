"""The local backend: a graph materialised as processes and directories on this machine."""
