"""Fixtures shared by tests/train: `foxes_dir`, a small character dataset prepared once a session
(the mesh tests train on it: test_fsdp, test_context_train)."""

import pytest

from flaxgpt.data import prepare

FOXES = "".join(f"the {i % 9} quick foxes jumped over {i % 4} lazy dogs.\n" for i in range(200))


@pytest.fixture(scope="session")
def foxes_dir(tmp_path_factory):
    """A prepared char dataset of FOXES (10% validation); runs write beside it, never into it."""
    out = tmp_path_factory.mktemp("data") / "foxes"
    prepare.prepare_text(FOXES, out, "char", 0.1, "generated")
    return out
