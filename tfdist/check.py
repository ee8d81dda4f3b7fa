"""Checks tfdist's upstream hooks against the installed TF, Keras and keras-hub.

    python -m tfdist.check              # one line per hook, then a summary
    python -m tfdist.check --markdown   # the table of docs/upstream_hooks.md

Each line is the hook's status (`ok`, `moved`, `missing`, `skipped` for an
optional package that is not installed), the upstream target, the tfdist
modules that rely on it and why. Exits 0 when every hook matches, 1 otherwise,
with the error every tfdist strategy would raise when created
(`tfdist.internal.hooks.verify`).
"""

import argparse
import sys
from typing import List, Optional, Sequence

from tfdist.internal import hooks


def report(statuses: Sequence[hooks.HookStatus]) -> List[str]:
    """The report's lines: one per hook, then the summary (and the error, if any)."""
    lines = []
    for s in statuses:
        modules = ", ".join(m.rsplit(".", 1)[-1] for m in s.hook.modules)
        line = f"{s.status:<8} {s.hook.target}  [{s.hook.kind}; {modules}] {s.hook.why}"
        if s.status != hooks.OK or s.hook.sha256 is None:
            line += f" ({s.detail})"
        lines.append(line)
    counts = {}
    for s in statuses:
        counts[s.status] = counts.get(s.status, 0) + 1
    tally = ", ".join(f"{n} {status}" for status, n in counts.items())
    versions = ", ".join(f"{package} {hooks.installed_version(package) or 'not installed'} "
                         f"(supported: {supported})"
                         for package, supported in hooks.SUPPORTED_VERSIONS.items())
    lines.append(f"{len(statuses)} upstream hooks: {tally}. Installed: {versions}.")
    message = hooks.mismatch_message(statuses)
    if message is not None:
        lines.append(message)
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tfdist.check", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--markdown", action="store_true",
                        help="print the table of docs/upstream_hooks.md instead")
    args = parser.parse_args(argv)
    if args.markdown:
        print(hooks.markdown_table(), end="")
        return 0
    statuses = hooks.check()
    print("\n".join(report(statuses)))
    return 0 if all(s.ok for s in statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
