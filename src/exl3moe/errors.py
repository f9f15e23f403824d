"""The two refusals of the library; both are ValueErrors that name the tensor and the rule."""


class FormatError(ValueError):
    """A tensor or file does not follow the EXL3 format."""

    def __init__(self, name: str, rule: str):
        self.name = name
        self.rule = rule
        super().__init__(f"{name}: {rule}")


class ContractError(ValueError):
    """A call does not meet the contract of an op (device, dtype, shape, workspace, table layout)."""

    def __init__(self, name: str, rule: str):
        self.name = name
        self.rule = rule
        super().__init__(f"{name}: {rule}")
