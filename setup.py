"""Maps the import names phasesplit.runtime and phasesplit.operator onto top-level folders.

operator/ has no top-level __init__.py on purpose (a regular package named `operator` on
sys.path would shadow the standard library), so packages are listed by walking the folders.
"""

from setuptools import find_namespace_packages, setup

ROOTS = {"phasesplit.runtime": "runtime", "phasesplit.operator": "operator"}

packages = []
for name, folder in ROOTS.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_namespace_packages(where=folder) if "__pycache__" not in sub]

setup(packages=packages, package_dir=ROOTS, package_data={"phasesplit.operator": ["*.yaml"], "phasesplit.runtime.kernels": ["*.c", "*.h"]})
