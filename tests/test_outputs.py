"""No silent success (issue 29, item 6): every requested output is checked before the work, and what is
written is checked after it. A figure with no browser, a figure too large for Chrome's canvas, junk from the
browser, a folder or a reader-less FIFO where a file belongs: each is a non-zero exit naming the output."""

from __future__ import annotations

import os

import pytest
from lens_fixtures import write_text_folder, write_tiny_model

import lenskit
from lenses.cli import figure_options, main
from lenses.plots import export

PROMPT = "def add(a, b):\n    return a + b"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("outputs")
    write_tiny_model(root / "model")
    write_text_folder(root / "heldout", n=6)
    return root


def commands(tiny, out: str, *extra: str) -> dict[str, list[str]]:
    model = str(tiny / "model")
    return {
        "lens": ["lens", PROMPT, "--model", model, "--out", out, *extra],
        "ablate": ["ablate", PROMPT, "--model", model, "--block", "1", "--out", out, *extra],
        "eval-lens": ["eval-lens", "--lens", "logit", "--model", model, "--data", str(tiny / "heldout"), "--tokens", "64",
                      "--ctx", "16", "--quiet", "--out", out],
    }


def no_model_load(monkeypatch):
    """Any model load fails the test: the outputs must be refused before the work starts."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the output was checked")
    monkeypatch.setattr(lenskit.HookedTransformer, "from_pretrained", refuse)


def one_line_error(capsys, *words: str) -> None:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize("name", ["lens", "ablate", "eval-lens"])
@pytest.mark.parametrize("suffix", [".png", ".pdf"])
def test_a_static_figure_without_a_browser_fails_before_the_work(tiny, tmp_path, monkeypatch, capsys, name, suffix):
    monkeypatch.setenv("BROWSER_PATH", str(tmp_path / "no-such-chrome"))
    no_model_load(monkeypatch)
    out = tmp_path / f"x{suffix}"
    assert main(commands(tiny, str(out))[name]) == 2
    one_line_error(capsys, str(out), "BROWSER_PATH")
    assert not out.exists()


@pytest.mark.parametrize("name", ["lens", "ablate", "eval-lens"])
def test_a_folder_as_the_figure_fails_before_the_work(tiny, tmp_path, monkeypatch, capsys, name):
    no_model_load(monkeypatch)
    folder = tmp_path / "fig.html"
    folder.mkdir()
    assert main(commands(tiny, str(folder))[name]) == 2
    one_line_error(capsys, str(folder), "folder")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
@pytest.mark.parametrize("name", ["lens", "ablate"])
def test_a_fifo_as_the_figure_is_refused(tiny, tmp_path, monkeypatch, capsys, name):
    no_model_load(monkeypatch)
    fifo = tmp_path / "fig.html"
    os.mkfifo(fifo)
    assert main(commands(tiny, str(fifo))[name]) == 2
    one_line_error(capsys, str(fifo), "FIFO")


@pytest.mark.parametrize("name", ["lens", "ablate"])
@pytest.mark.parametrize("flag", ["--width", "--height"])
def test_figure_sizes_are_bounded_up_front(tiny, tmp_path, capsys, name, flag):
    with pytest.raises(SystemExit) as exit_:
        main(commands(tiny, str(tmp_path / "x.png"), flag, "100000")[name])
    assert exit_.value.code == 2
    assert f"at most {figure_options.MAX_FIGURE_PX}" in capsys.readouterr().err


def test_the_bound_is_one_number_and_stated_in_help(capsys):
    assert figure_options.MAX_FIGURE_PX == export.MAX_FIGURE_PX
    with pytest.raises(SystemExit):
        main(["lens", "--help"])
    assert str(figure_options.MAX_FIGURE_PX) in capsys.readouterr().out


@pytest.mark.parametrize("size", [(100_000, 500, 1), (900, 9000, 1), (5000, 500, 4)], ids=["width", "height", "scaled"])
def test_save_figure_refuses_a_size_past_the_canvas_before_rendering(tmp_path, monkeypatch, size):
    import plotly.graph_objects as go

    monkeypatch.setattr(export, "_export_browser", lambda: pytest.fail("rendered a figure past the limit"))
    width, height, scale = size
    out = tmp_path / "x.png"
    with pytest.raises(export.FigureExportError, match="past the limit.*at most 8192 px"):
        export.save_figure(go.Figure(), out, width=width, height=height, scale=scale)
    assert not out.exists()


@pytest.mark.parametrize("suffix", [".png", ".pdf", ".svg"])
@pytest.mark.parametrize("junk", [b"\x00\x01\x02", b"", b"<html>not it</html>"], ids=["bytes", "empty", "html"])
def test_what_the_browser_returned_is_checked_before_it_is_written(tmp_path, monkeypatch, suffix, junk):
    import plotly.graph_objects as go

    class Junk:  # a browser that returns junk
        render = staticmethod(lambda fig, opts: junk)

    monkeypatch.setattr(export, "_export_browser", lambda: Junk)
    out = tmp_path / f"x{suffix}"
    with pytest.raises(export.FigureExportError, match=f"{out.name} was not written.*not {suffix[1:].upper()}"):
        export.save_figure(go.Figure(), out)
    assert not out.exists()


@pytest.mark.parametrize("fmt,data", [("png", b"\x89PNG\r\n\x1a\nrest"), ("pdf", b"%PDF-1.4\n"),
                                      ("svg", b'<svg xmlns="http://www.w3.org/2000/svg" width="1"/>'), ("svg", b"<svg/>")])
def test_real_signatures_pass(fmt, data, tmp_path):
    export.check_rendered(data, fmt, tmp_path / f"x.{fmt}")  # no exception


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
@pytest.mark.parametrize("name", ["lens", "ablate", "info"])
def test_a_fifo_without_a_reader_as_csv_fails_at_once(tiny, tmp_path, capsys, name):
    fifo = tmp_path / "table.csv"
    os.mkfifo(fifo)
    argv = {"lens": ["lens", PROMPT, "--model", str(tiny / "model"), "--csv", str(fifo)],
            "ablate": ["ablate", PROMPT, "--model", str(tiny / "model"), "--block", "0", "--csv", str(fifo)],
            "info": ["info", "--model", str(tiny / "model"), "--csv", str(fifo)]}[name]
    assert main(argv) == 2  # and not a hang: pytest's timeout is the CI's, this returns in a second
    one_line_error(capsys, str(fifo), "no process is reading")


@pytest.mark.parametrize("flag", ["--csv", "--table"])
def test_eval_lens_tables_refuse_a_folder_before_the_work(tiny, tmp_path, monkeypatch, capsys, flag):
    no_model_load(monkeypatch)
    folder = tmp_path / "t.csv"
    folder.mkdir()
    argv = ["eval-lens", "--lens", "logit", "--model", str(tiny / "model"), "--data", str(tiny / "heldout"), flag, str(folder)]
    assert main(argv) == 2
    one_line_error(capsys, str(folder), "folder", flag)


@pytest.mark.parametrize("name", ["lens", "info"])
def test_a_csv_to_a_character_device_is_a_stream(tiny, capsys, name):
    argv = {"lens": ["lens", PROMPT, "--model", str(tiny / "model"), "--csv", os.devnull],
            "info": ["info", "--model", str(tiny / "model"), "--csv", os.devnull]}[name]
    assert main(argv) == 0


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
def test_a_fifo_config_json_does_not_hang_info(tmp_path, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    os.mkfifo(folder / "config.json")
    assert main(["info", "--model", str(folder)]) == 2
    one_line_error(capsys, "config.json", "FIFO")
