"""Page-granular radix prefix cache with CP page-owner metadata.

Why page-granular: under owner-sharded KV every cached page has one owner
rank, and the planner only accepts page-aligned prefixes.  So the tree keys
whole pages: every node's key is a multiple of ``page_size`` tokens, a match
returns a page multiple, and splits happen only on page boundaries.  A
prompt's partial last page is never inserted (it is freed after the batch).

Why no communication: every rank runs the same sequence of operations on
data that is identical across the CP group (token ids, owner sequences,
lane occupancy counted per lane on every rank, a logical LRU clock), so the
tree's shape, its LRU order and every eviction decision are identical on all
ranks.  Only a node's *physical* pages differ per rank (``-1`` where another
rank owns the page).  ``CPGRAPH_DEBUG=1`` lets :func:`check_consistent`
compare a fingerprint of the rank-independent state in one collective.

Why a continuation token per node (``next_token``): with an MTP draft layer
in the pool (docs/mtp.md) the draft's record at row ``i`` depends on token
``i + 1``, so a node's last row encodes the token that followed the node
when it was computed.  Inside a node that token is the node's own next key
token; at the node's end it is ``next_token``.  A tree built with
``draft_records=True`` accepts a matched path only up to the first node end
whose ``next_token`` differs from the request's token there, minus that
page (recomputed for this request); without a draft nothing is checked.

Why views: a 64K-token hit walks a long path; copying the key tail at every
node makes matching quadratic.  :class:`TokenKey` slices in O(1) over one
shared backing buffer; a node keeps a compact ``bytes`` copy of its own key
(int32 tokens), compared with one ``memcmp``-style bytes comparison.

The package splits by concern: :mod:`.keys` (token keys), :mod:`.node`
(node bookkeeping and CP metadata), :mod:`.lanes` (the mirrored lane
ledger), :mod:`.tree` (walk, match, split, insert, locks), :mod:`.eviction`
(LRU eviction of L1 and L2) and :mod:`.consistency` (the debug fingerprint
check).
"""

from .consistency import check_consistent, tree_fingerprint
from .keys import TokenKey, int_array
from .lanes import LaneLedger
from .node import MAX_CP_SIZE, CPNodeMeta, InsertResult, MatchResult, RadixNode, check_pages_match_owners
from .tree import RadixCache

__all__ = ["MAX_CP_SIZE", "CPNodeMeta", "InsertResult", "LaneLedger", "MatchResult", "RadixCache", "RadixNode",
           "TokenKey", "check_consistent", "check_pages_match_owners", "int_array", "tree_fingerprint"]
