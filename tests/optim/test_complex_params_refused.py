"""Complex parameters are refused by name on every optimizer (issue 29, item 4).

The rules are TF's and Keras's for real weights; run on a complex tensor they trained silently wrong
(off torch.optim's ``view_as_real`` reference) or failed inside torch. Refused at construction and by
``add_param_group``, with a ``TypeError`` naming the parameter; the real-valued form the message
recommends trains as torch.optim trains the complex one through ``view_as_real``.
"""

from __future__ import annotations

import pytest
import torch
from optim_registry import OPTIMIZER_INFOS, OptimizerInfo


@pytest.mark.parametrize("info", OPTIMIZER_INFOS, ids=lambda i: i.name)
def test_complex_parameter_is_refused_by_name(info: OptimizerInfo) -> None:
    real = torch.nn.Parameter(torch.ones(3, 2))
    cplx = torch.nn.Parameter(torch.ones(4, 2, dtype=torch.complex64))
    with pytest.raises(TypeError, match=r"Parameter param_groups\[0\]\['params'\]\[1\] \(shape \(4, 2\)\) is complex "
                                        r"\(torch.complex64\): " + info.cls.__name__):
        info.cls([real, cplx], **info.default)
    with pytest.raises(TypeError, match=r"Parameter 'head.z' \(shape \(4, 2\)\) is complex"):
        info.cls([("head.w", real), ("head.z", cplx)], **info.default)
    opt = info.cls([real], **info.default)
    with pytest.raises(TypeError, match=r"Parameter param_groups\[1\]\['params'\]\[0\] .* is complex"):
        opt.add_param_group({"params": [cplx]})
    assert len(opt.param_groups) == 1  # not added


@pytest.mark.parametrize("info", OPTIMIZER_INFOS, ids=lambda i: i.name)
def test_the_recommended_real_form_trains(info: OptimizerInfo) -> None:
    """A complex weight kept as ``[..., 2]`` real (``view_as_complex`` in forward) trains, finite."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3, 2))
    opt = info.cls([w], **info.default)
    x = torch.randn(5, 3, dtype=torch.complex64)
    before = w.detach().clone()
    for _ in range(3):
        loss = (x @ torch.view_as_complex(w).T).abs().square().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert torch.isfinite(w).all() and not torch.equal(w, before)
