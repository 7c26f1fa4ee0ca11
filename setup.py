"""The package list, found rather than written out: every folder under the three roots is a
package (data folders such as the pack's example workflows included), so a new family's folder
ships without an edit here. The rest of the project's metadata is in pyproject.toml."""

from setuptools import find_namespace_packages, setup

# Import name -> the folder that holds it.
ROOTS = {"gmlx_contract": "shared", "gmlx_server": "server", "gmlx_comfy": "comfy_nodes"}


def packages() -> list[str]:
    found = []
    for name, root in ROOTS.items():
        subs = find_namespace_packages(root, exclude=["__pycache__", "*.__pycache__"])
        found += [name, *(f"{name}.{sub}" for sub in subs)]
    return found


if __name__ == "__main__":  # as setuptools' build backend and pip run it; tests import packages()
    setup(package_dir=ROOTS, packages=packages())
