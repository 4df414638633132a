"""Backends: one file per kind of recoverable unit, each with a `dispatch_<backend>(module, fqn, ctx)`."""
