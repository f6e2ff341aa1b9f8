"""The run configuration (torch-free: `accum-sched check` runs on login nodes). See schema.py."""
from launcher.config.schema import (FSDP_SCHEMA, LR_SCHEDULERS, OPTIMIZERS, REQUIRED, SCHEMA, Config, Field, Section,
                                    apply_overrides, dump, load_config, read_yaml, validate, write_resolved)
from launcher.errors import ConfigError

__all__ = ["Config", "ConfigError", "FSDP_SCHEMA", "Field", "LR_SCHEDULERS", "OPTIMIZERS", "REQUIRED", "SCHEMA",
           "Section", "apply_overrides", "dump", "load_config", "read_yaml", "validate", "write_resolved"]
