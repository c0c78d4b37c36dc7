"""``python -m streampos.synapse <synapse app module> <its arguments>``

Installs ``StreamposIdGenerator`` in Synapse, then runs the app module as
``python -m <module>`` would, e.g.::

    python -m streampos.synapse synapse.app.homeserver -c homeserver.yaml
    python -m streampos.synapse synapse.app.generic_worker -c homeserver.yaml -c worker.yaml
"""

import runpy
import sys


def main(argv: list) -> None:
    if len(argv) < 2 or argv[1] in ("-h", "--help") or argv[1].startswith("-"):
        sys.stderr.write(
            "usage: python -m streampos.synapse <synapse app module> [arguments...]\n"
            "  e.g. python -m streampos.synapse synapse.app.homeserver -c homeserver.yaml\n"
        )
        sys.exit(2)
    module = argv[1]
    if module != "synapse" and not module.startswith("synapse."):
        sys.stderr.write(f"streampos.synapse: {module!r} is not a Synapse module\n")
        sys.exit(2)
    from . import install

    install()
    sys.argv = [module, *argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv)
