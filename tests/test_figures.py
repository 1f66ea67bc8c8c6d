"""experiments/figures.py: the shared plot pieces draw what they are given."""

from experiments import figures


def test_lines_draws_each_series_in_order_and_styles_the_axis(tmp_path):
    plt = figures.pyplot()
    fig, ax = plt.subplots()
    series = {"full": ([1024, 2048], [3.0, 0.75]), "window": ([1024, 2048], [6.0, 3.0])}
    figures.lines(ax, series, xlog2=True, ylog=True, xlabel="N", ylabel="steps / s", title="t", legend=7)
    assert [line.get_label() for line in ax.lines] == ["full", "window"]
    for line, (xs, ys) in zip(ax.lines, series.values(), strict=True):
        assert list(line.get_xdata()) == xs and list(line.get_ydata()) == ys
        assert line.get_marker() == "o" and line.get_linestyle() == "-"
    assert ax.get_xscale() == "log" and ax.xaxis.get_transform().base == 2 and ax.get_yscale() == "log"
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == ("N", "steps / s", "t")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["full", "window"]
    figures.save_figure(fig, tmp_path / "f.png")
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_style_leaves_unset_what_it_is_not_given():
    plt = figures.pyplot()
    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4], label="a")
    figures.style(ax, ylabel="y")
    assert ax.get_xscale() == "linear" and ax.get_yscale() == "linear" and ax.get_legend() is None
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == ("", "y", "")
    plt.close(fig)


def test_inside_discarded_a_figure_is_closed_unsaved_and_outside_it_is_saved_again(tmp_path):
    plt = figures.pyplot()
    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    with figures.discarded():
        figures.save_figure(fig, tmp_path / "dropped.png")
    assert not (tmp_path / "dropped.png").exists()
    assert not plt.fignum_exists(fig.number)  # closed all the same: no figure piles up in pyplot
    fig2, _ = plt.subplots()
    figures.save_figure(fig2, tmp_path / "kept.png")  # the context is over
    assert (tmp_path / "kept.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_docs_regenerate_a_report_without_drawing_its_figures(tmp_path, monkeypatch):
    """experiments.docs keeps a report's text only: inside its tables, save_figure writes nothing."""
    from experiments import docs

    saved = []

    def report(folder):
        plt = figures.pyplot()
        fig, _ = plt.subplots()
        figures.save_figure(fig, folder / "fig.png")
        saved.append((folder / "fig.png").exists())
        return "text"

    monkeypatch.setattr(docs.importlib, "import_module", lambda name: type("M", (), {"report": staticmethod(report)}))
    (tmp_path / "results").mkdir()
    assert docs.Table("m:report", "results")(tmp_path) == "text\n"
    assert saved == [False] and not (tmp_path / "results" / "fig.png").exists()
