"""experiments/tables.py: the one markdown table writer and the shared cell formats, by hand."""

import doctest

import pytest

from experiments import common, tables


def test_markdown_table_by_hand():
    got = tables.markdown_table(["model", "acc", "note"], [["vit", 1.5, None], ["cnn", "-", ""], ["mlp"]])
    assert got == "| model | acc | note |\n|---|---|---|\n| vit | 1.5 |  |\n| cnn | - |  |\n| mlp |"
    assert tables.markdown_table(["a"], []) == "| a |\n|---|"
    with pytest.raises(ValueError, match="3 cells, the header 2"):
        tables.markdown_table(["a", "b"], [[1, 2, 3]])


def test_common_keeps_the_writer_and_mean_std():
    # benchmarks and older code import them from experiments.common: the same functions
    assert common.markdown_table is tables.markdown_table
    assert common.mean_std is tables.mean_std


@pytest.mark.parametrize(
    "x, want", [(1239.4, "1239"), (100.0, "100"), (99.96, "100.0"), (71.64, "71.6"), (9.416, "9.42"), (0.0042, "0.00")]
)
def test_ms_three_figures(x, want):
    assert tables.ms(x) == want


def test_size_label_and_span():
    assert [tables.size_label(n) for n in (512, 1024, 4096, 3000)] == ["512", "1K", "4K", "3000"]
    assert tables.span([803.1, 838.2, 755.0]) == "755-838"
    assert tables.span([23.71, 23.69]) == "23.7"  # the same once written: one value
    assert tables.span([0.5, 0.25], lambda v: f"{v:.2f}x", sep=" to ") == "0.25x to 0.50x"
    with pytest.raises(ValueError, match="at least one"):
        tables.span([])


def test_docstring_examples():
    assert doctest.testmod(tables).failed == 0
