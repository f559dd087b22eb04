"""The comparison script's pure parts: it must rewrite only its own section of docs/benchmarks.md."""

import importlib.util
import sys
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "bench_compare", Path(__file__).resolve().parents[1] / "bench" / "compare.py")
compare = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = compare  # dataclasses look their module up there
spec.loader.exec_module(compare)


def test_splice_appends_then_replaces_only_its_section():
    engine = "# Benchmarks\n\n## Engine\n\nengine numbers\n"
    first = compare.splice(engine, f"{compare.BEGIN}\n## Serving\nv1\n{compare.END}\n")
    assert first.startswith(engine.rstrip("\n"))
    assert "v1" in first
    # The engine engineer adds text after ours; a re-render keeps it and swaps our section.
    edited = first + "\n## Later section\nkept\n"
    second = compare.splice(edited, f"{compare.BEGIN}\n## Serving\nv2\n{compare.END}\n")
    assert "v1" not in second and "v2" in second
    assert "engine numbers" in second and "## Later section\nkept" in second
    assert second.count(compare.BEGIN) == 1 and second.count(compare.END) == 1


def test_splice_into_empty_doc():
    out = compare.splice("", f"{compare.BEGIN}\nx\n{compare.END}\n")
    assert out.startswith("# Benchmarks\n\n" + compare.BEGIN)


def test_prompts_per_point_are_bounded():
    assert compare.n_prompts(0.1, 1.0) == compare.MIN_PROMPTS
    assert compare.n_prompts(0.5, 1.0) == 15
    assert compare.n_prompts(100.0, 1.0) == compare.MAX_PROMPTS
