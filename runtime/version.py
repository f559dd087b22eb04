"""The phasesplit version: pyproject.toml's, read from the installed package's metadata.

Everything that names a version (pod labels, the default runtime image, `phasesplit --version`)
takes it from here; charts/phasesplit/Chart.yaml cannot import Python, so a unit test checks it
against this value.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("phasesplit")
except PackageNotFoundError as e:  # a source tree on sys.path without `pip install -e .`
    raise ImportError("phasesplit is not installed (pip install -e .): its version comes from the "
                      "package metadata") from e
