"""``SafeLoadPlanner``: DCP's default load planner without pickle for non-tensor values."""

from __future__ import annotations

import io

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that unpickles non-tensor values with ``weights_only=True``.

    DCP stores non-tensor values (step counters, ``param_groups``) with ``torch.save``; the
    default planner loads them with ``weights_only=False``, which runs arbitrary pickle code.
    This one admits only plain containers, numbers, strings and tensors.
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
