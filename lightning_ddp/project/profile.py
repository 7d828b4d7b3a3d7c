"""The old home of the compute-profile schema, now ``lightning_ddp.profile``; these names still import from here."""

from lightning_ddp.profile import SCHEMA, ComputeProfile, ParamTiming, read_profile, write_atomically, write_profile

__all__ = ["SCHEMA", "ComputeProfile", "ParamTiming", "read_profile", "write_atomically", "write_profile"]
