"""The role a switchable worker takes from its pod's downward-API labels at start."""

from __future__ import annotations

from pathlib import Path

import pytest
from splitserve_worker.server.pod_labels import LabelsError, parse_labels, role_from_labels

pytestmark = pytest.mark.unit

ROLES = ("prefill", "decode", "both")
LABEL = "splitserve.io/role"


def test_the_kubelets_quoted_lines_are_read() -> None:
    text = 'app.kubernetes.io/instance="demo"\nsplitserve.io/role="prefill"\nodd="a\\"b"\n'
    assert parse_labels(text) == {
        "app.kubernetes.io/instance": "demo",
        LABEL: "prefill",
        "odd": 'a"b',
    }


def test_the_label_wins_over_the_flag_and_its_absence_keeps_the_flag(tmp_path: Path) -> None:
    labels = tmp_path / "labels"
    labels.write_text(f'{LABEL}="decode"\n')
    assert role_from_labels(labels, LABEL, ROLES, "both") == "decode"
    labels.write_text('app="x"\n')
    assert role_from_labels(labels, LABEL, ROLES, "both") == "both"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (f'{LABEL}="router"\n', "not a role: set it to one of prefill, decode, both"),
        (f"{LABEL}=decode\n", 'is not key="value"'),
    ],
)
def test_a_bad_label_says_what_to_do(tmp_path: Path, text: str, fragment: str) -> None:
    labels = tmp_path / "labels"
    labels.write_text(text)
    with pytest.raises(LabelsError, match=fragment):
        role_from_labels(labels, LABEL, ROLES, "both")


def test_a_missing_file_says_to_mount_it(tmp_path: Path) -> None:
    with pytest.raises(LabelsError, match=r"mount the downward API's metadata\.labels"):
        role_from_labels(tmp_path / "none", LABEL, ROLES, "both")
