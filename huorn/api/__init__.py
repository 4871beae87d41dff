"""Pydantic models of Huorn's custom resources (group huorn.io, version v1alpha1).

The CRD YAML under crds/ is generated from these models by `huorn crds`; never edit it by hand.
"""
