"""The launcher's error types: ConfigError, which the command turns into `error: <field>: <what>; <fix>` and exit
status 2, and CheckpointError (torch-free here, so the back ends raise it without importing the checkpointer)."""


class ConfigError(Exception):
    """Bad user input. `field` is the dotted config path (or argument name) at fault, `hint` says how to fix it."""

    def __init__(self, field: str, problem: str, hint: str = ""):
        self.field, self.problem, self.hint = field, problem, hint
        super().__init__(self.line())

    def line(self) -> str:
        text = f"{self.field}: {self.problem}" if self.field else self.problem
        return f"{text}; {self.hint}" if self.hint else text


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (damaged, another config, another world size): raised on every rank."""
