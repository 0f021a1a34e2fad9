"""common/tools/setup.py's stamp: `make setup` skips its import checks only while the stamp's key
holds, and a package installed or removed since breaks it."""

import os

import pytest

from common.tools import setup


def test_the_stamp_holds_until_site_packages_changes(tmp_path, monkeypatch):
    site_packages = tmp_path / "site-packages"
    site_packages.mkdir()
    monkeypatch.setattr(setup.site, "getsitepackages", lambda: [str(site_packages)])
    monkeypatch.setattr(setup, "STAMP", str(tmp_path / "stamp"))
    assert not setup.stamped()  # none written yet
    setup.write_stamp("cutlass-dsl 4.8.1")
    assert setup.stamped()
    (site_packages / "new_package").mkdir()  # a package installed
    os.utime(site_packages, ns=(1, 1))  # the folder's time moves, whatever the clock's resolution
    assert not setup.stamped()
    setup.write_stamp("cutlass-dsl 4.8.1")
    assert setup.stamped()
    monkeypatch.setattr(setup.sys, "executable", "/another/python")  # another interpreter
    assert not setup.stamped()


def test_the_stamp_breaks_when_requirements_change(tmp_path, monkeypatch):
    monkeypatch.setattr(setup.site, "getsitepackages", lambda: [])
    monkeypatch.setattr(setup, "STAMP", str(tmp_path / "stamp"))
    monkeypatch.chdir(tmp_path)  # stamp_key reads requirements.txt from the working directory
    (tmp_path / "requirements.txt").write_text("torch\n")
    setup.write_stamp("s")
    assert setup.stamped()
    (tmp_path / "requirements.txt").write_text("torch\nnew-package\n")
    assert not setup.stamped()


def test_a_stamped_setup_checks_nothing_and_full_checks_again(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(setup, "STAMP", str(tmp_path / "stamp"))
    setup.write_stamp("the summary")
    probes = []
    monkeypatch.setattr(setup, "importable_all", lambda mods: probes.append(mods) or {})
    assert setup.main([]) == 0
    assert probes == [] and "as checked before: the summary" in capsys.readouterr().out
    with pytest.raises(KeyError):  # the stub answers no module: the check ran, and stops there
        setup.main(["--full"])
    assert probes
