"""Debug check that the radix tree is identical on every rank of the CP group."""

from __future__ import annotations

import hashlib


def tree_fingerprint(tree) -> str:
    """SHA-256 over the rank-independent state (shape, keys, owners, residency, locks, LRU clock)."""
    h = hashlib.sha256()
    h.update(f"{tree.page_size}|{tree._clock}|{tree.device_pages_total}|{tree.locked_pages}".encode())
    stack = [tree.root]
    while stack:
        node = stack.pop()
        h.update(node.key)
        h.update(node.meta.page_owners.tobytes())
        h.update(f"|{node.node_id}|{node.on_device}|{node.on_host}|{sorted(node.host_payloads)}|"
                 f"{node.lock_ref}|{node.last_access}|{node.next_token}|{len(node.children)}".encode())
        stack.extend(node.children[k] for k in sorted(node.children))
    return h.hexdigest()


def check_consistent(tree, group=None, device="cpu", force: bool = False) -> None:
    """Debug: compare ``tree.fingerprint()`` across the CP group in ONE collective (all-gather).

    Runs only with ``CPGRAPH_DEBUG=1`` (or ``force``); raises ``RuntimeError``
    naming the ranks whose tree differs from rank 0's.
    """
    if not force:
        from cpgraph.ops.checks import debug_enabled

        if not debug_enabled():
            return
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    digest = torch.frombuffer(bytearray(bytes.fromhex(tree.fingerprint())), dtype=torch.uint8).to(device)
    out = [torch.empty_like(digest) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, digest, group=group)
    bad = [r for r, d in enumerate(out) if not torch.equal(d, out[0])]  # sync-ok (debug only)
    if bad:
        raise RuntimeError(f"radix tree diverged across CP ranks: ranks {bad} differ from rank 0")

