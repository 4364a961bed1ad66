"""``inferq console``: the console's URL, printed (and opened with ``--open``)."""

from __future__ import annotations

import webbrowser

from inferq.cli import main


def test_it_prints_the_consoles_url_of_the_default_gateway(capsys):
    assert main(["console"], environ={}) == 0
    assert capsys.readouterr().out.strip() == "http://127.0.0.1:8000/console"


def test_open_opens_the_url_given_and_says_so_when_no_browser_can(capsys, monkeypatch):
    opened: list[str] = []
    monkeypatch.setattr(webbrowser, "open", lambda url: opened.append(url) or False)
    assert main(["console", "--url", "http://gw:9000/", "--open"], environ={}) == 0
    assert opened == ["http://gw:9000/console"]
    out = capsys.readouterr()
    assert out.out.strip() == "http://gw:9000/console"
    assert "no web browser" in out.err
