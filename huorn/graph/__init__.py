"""The execution graph: compile a resource into vertices and edges, mutate it at run time,
serialise it into the resource's status. `graph.compile(job)` is the entry point."""

from huorn.graph import jobs as _jobs  # noqa: F401 - registers the built-in compilers
from huorn.graph.compiler import compile, load_resource, register, registered_kinds

__all__ = ["compile", "load_resource", "register", "registered_kinds"]
