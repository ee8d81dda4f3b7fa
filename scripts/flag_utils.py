"""Helpers shared by the absl entry points in scripts/ (flags live only here)."""

from absl import flags

from tfdist.mesh import LayoutRules, MeshShape


def _parses(parse):
    def check(value):
        try:
            parse(value)
        except ValueError as e:
            raise flags.ValidationError(str(e)) from None
        return True

    return check


def validate_mesh_flags(mesh_flag: str = "mesh_shape", layout_flag: str = "layout") -> None:
    """Rejects a malformed mesh shape or layout at flag parsing, with the parser's message."""
    flags.register_validator(mesh_flag, _parses(MeshShape.parse), "")
    flags.register_validator(layout_flag, _parses(LayoutRules.parse), "")
