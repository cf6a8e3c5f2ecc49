"""One model-free server for the load, overload and schema-fuzz tests of this folder."""

from __future__ import annotations

import pytest
from null_server import NULL_MAX_MODEL_LEN, NULL_MAX_SEQS, NULL_MAX_WAITING, NullServer


@pytest.fixture(scope="session")
def null_server():
    srv = NullServer(step_ms=1, max_num_seqs=NULL_MAX_SEQS, max_waiting=NULL_MAX_WAITING,
                     max_model_len=NULL_MAX_MODEL_LEN)
    yield srv
    srv.stop()
