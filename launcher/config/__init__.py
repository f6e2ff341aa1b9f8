"""The run configuration (torch-free: `accum-sched check` runs on login nodes). The keys are declared in
sections.py (and each back end's options in its module in launcher/backends); schema.py validates against them with
pydantic; reference.py prints the table in docs/cli.md; json_schema.py the JSON Schema of `accum-sched schema`."""
from launcher.backends.fsdp import FSDPConfig
from launcher.config.schema import (
                                    FSDP_SCHEMA,
                                    LR_SCHEDULERS,
                                    OPTIMIZERS,
                                    REQUIRED,
                                    SCHEMA,
                                    Config,
                                    Field,
                                    Section,
                                    apply_overrides,
                                    dump,
                                    load_config,
                                    read_yaml,
                                    validate,
                                    write_resolved,
)
from launcher.config.sections import (
                                    AccumulationConfig,
                                    CheckpointConfig,
                                    DataConfig,
                                    DistributedConfig,
                                    EvalConfig,
                                    LoggingConfig,
                                    LRSchedulerConfig,
                                    OptimizerConfig,
                                    RunConfig,
                                    SlurmConfig,
                                    TaskConfig,
)
from launcher.errors import ConfigError

__all__ = ["FSDP_SCHEMA", "LR_SCHEDULERS", "OPTIMIZERS", "REQUIRED", "SCHEMA", "AccumulationConfig", "CheckpointConfig",
           "Config", "ConfigError", "DataConfig", "DistributedConfig", "EvalConfig", "FSDPConfig", "Field",
           "LRSchedulerConfig", "LoggingConfig", "OptimizerConfig", "RunConfig", "Section", "SlurmConfig",
           "TaskConfig", "apply_overrides", "dump", "load_config", "read_yaml", "validate", "write_resolved"]
