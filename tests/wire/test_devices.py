"""Device names: one parser for the copier, the copy jobs, the one-sided regions
and the store server's --device."""

from __future__ import annotations

import pytest

from kvstore.wire.devices import HOST, Device


@pytest.mark.parametrize(
    "text,device",
    [("cpu", HOST), ("cuda", Device(0)), ("cuda:0", Device(0)), ("cuda:13", Device(13))],
)
def test_a_device_name_parses_and_prints_back(text, device):
    assert Device.parse(text) == device
    assert Device.parse(str(device)) == device
    assert device.is_host == (text == "cpu")


@pytest.mark.parametrize(
    "text", ["", "CPU", "gpu:0", "cuda:", "cuda:x", "cuda:-1", "cuda:\u0661", "cpu:0"]
)
def test_any_other_name_is_refused_naming_it(text):
    with pytest.raises(ValueError, match=f"device {text!r}: expected cpu, cuda or cuda:N"):
        Device.parse(text)
