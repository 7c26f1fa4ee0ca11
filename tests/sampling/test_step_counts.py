"""One step-count rule for every variant, read from its status `sampling` alone
(docs/contract.md §2.3): a published `sigmas` schedule is fixed, any other takes any count."""

from __future__ import annotations

import pytest
from gmlx_server.engine.registry import ModelRegistry, embedded_modules
from gmlx_server.engine.sampling import SettingError, resolve_sigmas


@pytest.fixture(scope="module")
def statuses(tmp_path_factory):
    root = tmp_path_factory.mktemp("embedded")
    folders = [module.ensure_embedded_model(root) for module in embedded_modules()]
    registry = ModelRegistry([], None, extra_models=folders)
    return {folder.name: registry.describe(folder.name) for folder in folders}


def test_a_variant_refuses_other_step_counts_exactly_when_it_publishes_sigmas(statuses):
    fixed = set()
    for model_id, status in statuses.items():
        sampling = status["sampling"]
        default = sampling["steps"]
        assert len(resolve_sigmas(sampling, None, 64, 64, pixels_per_token=16)) == default + 1
        if sampling["sigmas"] is None:
            sigmas = resolve_sigmas(sampling, default + 3, 64, 64, pixels_per_token=16)
            assert len(sigmas) == default + 4 and sigmas[-1] == 0.0, model_id
            continue
        fixed.add(model_id)
        assert len(sampling["sigmas"]) == default + 1 and sampling["sigmas"][-1] == 0.0
        for steps in (default - 1, default + 1):
            with pytest.raises(SettingError, match=f"fixed {default}-step schedule"):
                resolve_sigmas(sampling, steps, 64, 64, pixels_per_token=16)
    # the turbo of Qwen-Image 2.1 publishes its schedule; Z-Image turbo and klein do not
    assert fixed == {"qwen-image21-random-tiny"}, statuses.keys()
