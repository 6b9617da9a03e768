"""Workers: the inference engine, the worker process and its fleet.

Other packages import only `workers.api` (the contract: wire types, validation, the
client); the sub-packages are mapped in docs/architecture.md.
"""
