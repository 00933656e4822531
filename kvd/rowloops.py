"""Compiled loops over request rows (numba): the per-request decisions of a step.

Appends and forks are per-request sequential logic: "in batch order, the first ``ref - 1`` writers
of a shared block copy it", "each child copies its own parent's table". numpy can only express
them as a chain of whole-array calls (argsorts, repeats, masks), each costing a microsecond of call
overhead however small the batch: a fork of one request into 8 children took ~60 of them. Here
each is one native loop, so a step costs a few calls whatever its shape.

Only numbers and numpy arrays cross this boundary (the manager's and the pool's own arrays,
written in place); the free queue's order stays in Python (``kvd.pool``), and the prefix-cache
index has its own loops (``kvd.prefixindex``).

Functions are compiled on first use and cached on disk (``NUMBA_CACHE_DIR`` overrides where);
``warm_up`` loads them all, as the daemon does at start. Bounds are not checked: every index is
validated by the plan or by the manager first. ``NUMBA_BOUNDSCHECK=1`` turns checks on and
``NUMBA_DISABLE_JIT=1`` runs the loops as plain Python (the test suite passes both ways), as does
a daemon installed without numba (it is the optional extra ``kvd[fast]``).
"""

from __future__ import annotations

import numpy as np

from kvd.api import NULL_BLOCK

try:
    from numba import njit
except ImportError:  # numba is an optional extra (kvd[fast]): the same loops as plain Python
    njit = None

HAVE_NUMBA = njit is not None
"""False when numba is not installed: every loop runs as plain Python (same results, slower;
``kvd.bench.core`` measures both ways, see the README's packaging notes)."""

#: ``plan_appends`` result when the batch is not the usual valid one (an unknown, swapped or
#: repeated row, a bad size or hash count): the manager's general path then reports each misuse.
DECLINED = -1

_jit = njit(cache=True, nogil=True, boundscheck=False) if HAVE_NUMBA else (lambda fn: fn)


@_jit
def plan_appends(rows, n_scalar, n_array, lookahead, hash_counts, max_model_len,
                 num_tokens, appendable, forked, any_forked, mark,
                 table, num_blocks, num_registered, ref_cnt, block_size,
                 old_out, grow_out, cow_out):
    """Decide a batch of appends to one full-attention group. Changes nothing.

    ``n_array`` (one count per request) is used when it is not empty, else ``n_scalar`` for all;
    ``hash_counts`` is empty when no hashes were given. Fills, per request, the tokens it had
    (``old_out``), the blocks it must add (``grow_out``) and whether it first copies its shared,
    partly filled last block (``cow_out``). Returns the blocks needed in all, or DECLINED.
    ``mark`` is an int32 scratch array over rows (any contents): each request writes its index
    at its row, so a row named before in the batch reads back an earlier index naming it.
    """
    n = rows.size
    R = num_tokens.size
    for i in range(n):
        row = rows[i]
        if row < 0 or row >= R or not appendable[row]:
            return DECLINED
        seen = mark[row]
        if 0 <= seen < i and rows[seen] == row:
            return DECLINED
        mark[row] = i
    need = 0
    planned = n
    for i in range(n):
        row = rows[i]
        k = n_array[i] if n_array.size else n_scalar
        old = num_tokens[row]
        new = old + k
        bad = k < 0 or new > max_model_len
        if hash_counts.size and not bad:
            # At most the full, unregistered blocks, without a division (see below); c > new first
            # so that the product cannot overflow.
            c = hash_counts[i]
            bad = c < 0 or c > new or (np.int64(num_registered[row]) + c) * block_size > new
        if bad:
            need = DECLINED
            planned = i
            break
        old_out[i] = old
        # Blocks to add: divide only when the row outgrows its blocks (a 64-bit division per row
        # was a third of a 4,096-request decode step's plan on the 2-core box).
        short = new + lookahead - np.int64(num_blocks[row]) * block_size
        if short <= 0:
            grow_out[i] = 0
        elif short <= block_size:  # the usual growth: one block, no division (see above)
            grow_out[i] = 1
        else:
            grow_out[i] = (short + block_size - 1) // block_size
        cow_out[i] = False
        if any_forked and k > 0 and old % block_size and forked[row]:
            block = table[row, old // block_size]
            if ref_cnt[block] > 1:
                # The first ref - 1 writers of a shared block copy it; the last writes in place.
                # Counted down while planning and restored below: planning changes nothing.
                cow_out[i] = True
                ref_cnt[block] -= 1
                need += 1
        need += grow_out[i]
    if any_forked:
        for i in range(planned):
            if cow_out[i]:
                ref_cnt[table[rows[i], old_out[i] // block_size]] += 1
    return need


@_jit
def apply_appends(rows, n_scalar, n_array, old, grow, cow, blocks,
                  num_tokens, table, num_blocks, last_block, ref_cnt, block_size,
                  copies_out, changed_out):
    """Carry out a plan of ``plan_appends`` with ``blocks`` fresh from the pool, handed out in
    batch order, each request's copy-on-write block before its new blocks (``last_block`` kept:
    see kvd.manager's _Group). Returns (copies made, rows whose tables changed), written to the
    front of ``copies_out`` and ``changed_out``."""
    pos = 0
    n_copies = 0
    n_changed = 0
    for i in range(rows.size):
        row = rows[i]
        changed = False
        if cow[i]:
            col = old[i] // block_size
            src = table[row, col]
            dst = blocks[pos]
            pos += 1
            table[row, col] = dst
            ref_cnt[src] -= 1  # the last writer keeps the block, so this never reaches zero
            copies_out[n_copies, 0] = src
            copies_out[n_copies, 1] = dst
            n_copies += 1
            changed = True
        g = grow[i]
        # The usual growth by one block takes no inner loop, and no row's last block is read back
        # from the table it was just stored to: with both, a 4,096-request growth step's loop took
        # 1.7x as long on the 2-core box (42.7 against 24.5 µs, median of 40).
        if g == 1:
            nb = num_blocks[row]
            block = blocks[pos]
            pos += 1
            table[row, nb] = block
            num_blocks[row] = nb + 1
            last_block[row] = block
        elif g:
            nb = num_blocks[row]
            for j in range(g):
                table[row, nb + j] = blocks[pos]
                pos += 1
            num_blocks[row] = nb + g
            last_block[row] = blocks[pos - 1]
        elif changed:  # copied on write, grew no block: the copy may be its last block
            last_block[row] = table[row, num_blocks[row] - 1]
        if g or changed:
            changed_out[n_changed] = row
            n_changed += 1
        num_tokens[row] = old[i] + (n_array[i] if n_array.size else n_scalar)
    return n_copies, n_changed


@_jit
def mirror_appends(m_table, m_counts, m_rows, m_start, m_end, rows, old, grow, cow, table, num_blocks, last_block,
                   block_size):
    """Write what ``apply_appends`` changed into the caller's copy of the batch's tables (a
    daemon's session segment): request i's mirror row is ``m_rows[i]``, which gets the entries its
    copy-on-write and growth wrote and its new count; ``m_start``/``m_end`` (empty: none) widen each
    mirror row's range of changed entries (a GPU copy's tracker). Where a row grew by one block,
    that block is read from the dense ``last_block``, not from the row's table line. Stores to the
    mirror inside ``apply_appends``' own loop (a second cold line per row) made a 4,096-request
    growth step's ``append_batch`` 104-107 µs against 39-40; this pass takes 13-14 (the 2-core box,
    ``.dev/growth_parts2.py``), where the daemon's own publish pass took 22-24."""
    tracked = m_start.size > 0
    for i in range(rows.size):
        g = grow[i]
        if not g and not cow[i]:
            continue
        row = rows[i]
        srow = m_rows[i]
        nb = num_blocks[row]
        lo = nb - g
        if cow[i]:
            lo = min(lo, old[i] // block_size)
        if lo == nb - 1:  # the usual growth: its block is the row's last, in the dense array
            m_table[srow, lo] = last_block[row]
        else:
            for col in range(lo, nb):
                m_table[srow, col] = table[row, col]
        m_counts[srow] = nb
        if tracked:
            if lo < m_start[srow]:
                m_start[srow] = lo
            if nb > m_end[srow]:
                m_end[srow] = nb


@_jit
def append_batch(rows, n_scalar, n_array, lookahead, hash_counts, max_model_len,
                 num_tokens, appendable, forked, any_forked, mark,
                 table, num_blocks, last_block, num_registered, ref_cnt, block_size,
                 fresh, num_fresh, old_out, grow_out, cow_out, copies_out, changed_out):
    """``plan_appends`` then, when the fresh stack (``fresh[:num_fresh]``, taken from the top)
    holds the blocks needed, ``apply_appends`` with them: the usual step in one call. Returns
    (blocks needed or DECLINED, whether applied, copies made, rows changed); the caller checks
    the need against the pool, commits the taken blocks, or takes them itself (evicting) and
    applies."""
    need = plan_appends(rows, n_scalar, n_array, lookahead, hash_counts, max_model_len,
                        num_tokens, appendable, forked, any_forked, mark,
                        table, num_blocks, num_registered, ref_cnt, block_size,
                        old_out, grow_out, cow_out)
    if need < 0 or need > num_fresh:
        return need, False, 0, 0
    blocks = fresh[num_fresh - need:num_fresh][::-1]
    for j in range(need):
        ref_cnt[blocks[j]] = 1
    n_copies, n_changed = apply_appends(rows, n_scalar, n_array, old_out, grow_out, cow_out, blocks,
                                        num_tokens, table, num_blocks, last_block, ref_cnt, block_size,
                                        copies_out, changed_out)
    return need, True, n_copies, n_changed


@_jit
def append_batch_groups(rows, n_scalar, n_array, lookahead, hash_counts, max_model_len,
                        num_tokens, appendable, forked, any_forked, mark,
                        tables, num_blocks, last_blocks, num_registered, ref_cnt, block_sizes,
                        fresh, num_fresh, old_out, grow_out, cow_out, needs_out, copies_out, changed_out, changed):
    """``append_batch`` for several KV-cache groups (tuples of each group's arrays, ``hash_counts``
    each group's, empty: none): every group planned (group g's plan in ``grow_out[g]``,
    ``cow_out[g]``, its need in ``needs_out[g]``), then, when the fresh stack holds all of them,
    every group applied with its blocks in group order (as ``BlockPool.take`` would hand them out
    group after group), ``changed[i]`` set where request i's tables changed in any group. Returns
    (blocks needed in all or DECLINED, whether applied, copies made, in group order)."""
    n = rows.size
    total = 0
    for g in range(len(tables)):
        need = plan_appends(rows, n_scalar, n_array, lookahead, hash_counts[g], max_model_len,
                            num_tokens, appendable, forked, any_forked, mark,
                            tables[g], num_blocks[g], num_registered[g], ref_cnt, block_sizes[g],
                            old_out, grow_out[g], cow_out[g])
        if need < 0:
            return need, False, 0
        needs_out[g] = need
        total += need
    if total > num_fresh:
        return total, False, 0
    blocks = fresh[num_fresh - total:num_fresh][::-1]
    for j in range(total):
        ref_cnt[blocks[j]] = 1
    for i in range(n):
        changed[i] = False
    pos = 0
    n_copies = 0
    for g in range(len(tables)):
        k = needs_out[g]
        if k:
            for i in range(n):
                if grow_out[g, i] > 0 or cow_out[g, i]:
                    changed[i] = True
        c, _ = apply_appends(rows, n_scalar, n_array, old_out, grow_out[g], cow_out[g], blocks[pos:pos + k],
                             num_tokens, tables[g], num_blocks[g], last_blocks[g], ref_cnt, block_sizes[g],
                             copies_out[n_copies:], changed_out)
        pos += k
        n_copies += c
    return total, True, n_copies


@_jit
def fork_row_state(parents, children, num_tokens, priority, namespace, active, appendable, forked):
    """Children (free rows) take their parents' sizes, priority and namespace. Returns how many
    rows became forked (may now share a partly filled block)."""
    newly = 0
    for i in range(children.size):
        p = parents[i] if parents.size > 1 else parents[0]
        c = children[i]
        num_tokens[c] = num_tokens[p]
        priority[c] = priority[p]
        namespace[c] = namespace[p]
        active[c] = True
        appendable[c] = True
        if not forked[p]:
            forked[p] = True
            newly += 1
        forked[c] = True
        newly += 1
    return newly


@_jit
def share_blocks(parents, children, table, num_blocks, last_block, num_skipped, num_registered, ref_cnt,
                 num_tokens, block_size):
    """Each child's table becomes its parent's up to the parent's last token (``block_size`` 0:
    every block), sharing the blocks: one more reference each. Lookahead blocks stay the parent's."""
    for i in range(children.size):
        p = parents[i] if parents.size > 1 else parents[0]
        c = children[i]
        nb = num_blocks[p]
        if block_size:
            cap = (num_tokens[p] + block_size - 1) // block_size
            if cap < nb:
                nb = cap
        skip = num_skipped[p]
        for j in range(nb):
            b = table[p, j]
            table[c, j] = b
            if j >= skip and b != 0:
                ref_cnt[b] += 1
        num_blocks[c] = nb
        last_block[c] = table[c, nb - 1] if nb else NULL_BLOCK
        num_skipped[c] = skip
        num_registered[c] = min(num_registered[p], nb)


@_jit
def fork_rows(parents, children, num_tokens, priority, namespace, active, appendable, forked,
              table, num_blocks, last_block, num_skipped, num_registered, ref_cnt, block_size):
    """``fork_row_state`` then ``share_blocks`` of the first group: the usual fork in one call."""
    newly = fork_row_state(parents, children, num_tokens, priority, namespace, active, appendable, forked)
    share_blocks(parents, children, table, num_blocks, last_block, num_skipped, num_registered, ref_cnt,
                 num_tokens, block_size)
    return newly


@_jit
def drop_refs(blocks, ref_cnt, freed_out):
    """One reference less per entry, in order (ids may repeat); ``freed_out[i]``: entry i took its
    block's count to zero (so it is the block's last entry). Returns how many did, or DECLINED,
    having changed nothing, when a count would fall below zero."""
    n_freed = 0
    for i in range(blocks.size):
        b = blocks[i]
        if ref_cnt[b] <= 0:
            for j in range(i):
                ref_cnt[blocks[j]] += 1
            return DECLINED
        ref_cnt[b] -= 1
        freed_out[i] = ref_cnt[b] == 0
        n_freed += freed_out[i]
    return n_freed


@_jit
def drop_row_refs(table, rows, starts, stops, ref_cnt, freed_out, rep_out, n):
    """One reference less on every block ``rows`` hold in ``table`` (entries [start, stop) of each
    row, each row tail first; null entries skipped), in that order: what ``drop_refs`` does to
    those entries gathered, without gathering them. A block whose count reaches zero goes to
    ``freed_out[n]``, the index into ``rows`` of the row that freed it to ``rep_out[n]``, n += 1.
    Returns the new n, or DECLINED when a count would fall below zero (a bug: the counts are then
    partly dropped, and the caller asserts)."""
    for i in range(rows.size):
        row = rows[i]
        for j in range(stops[i] - 1, starts[i] - 1, -1):
            b = table[row, j]
            if b == NULL_BLOCK:
                continue
            if ref_cnt[b] <= 0:
                return DECLINED
            ref_cnt[b] -= 1
            if ref_cnt[b] == 0:
                freed_out[n] = b
                rep_out[n] = i
                n += 1
    return n


@_jit
def _window_skip(num_computed, window, block_size, nb):
    """Leading blocks a row of ``nb`` blocks no longer needs once ``num_computed`` tokens are
    computed (kvd.manager's ``_Group.skip_for``, capped at its blocks)."""
    skip = num_computed - window + 1
    if skip <= 0:
        return 0
    skip //= block_size
    return nb if skip > nb else skip


@_jit
def window_slides(rows, num_computed, window, block_size, num_blocks, num_skipped, table, num_registered,
                  unconfirmed_by):
    """How many table entries ``slide_windows`` would release, and whether one of them is a block
    whose registration or confirmation may still wait (past the row's registered blocks, or
    unconfirmed). Changes nothing."""
    total = 0
    waits = False
    for i in range(rows.size):
        row = rows[i]
        skip = _window_skip(num_computed[i], window, block_size, num_blocks[row])
        start = num_skipped[row]
        if skip <= start:
            continue
        total += skip - start
        if skip > num_registered[row]:
            waits = True
        elif not waits:
            for j in range(start, skip):
                b = table[row, j]
                if b != NULL_BLOCK and unconfirmed_by[b] != 0:
                    waits = True
                    break
    return total, waits


@_jit
def slide_windows(rows, num_computed, window, block_size, table, num_blocks, num_skipped, ref_cnt,
                  freed_out, rep_out, moved_out):
    """Release the blocks of a sliding-window group that ``rows`` no longer need once
    ``num_computed[i]`` tokens of row i are computed: each row's entries from its new skip count
    down to its old one (tail first, row after row) become NULL_BLOCK and drop a reference, as
    ``BlockPool.release`` of those entries gathered would. A block whose count reaches zero goes to
    ``freed_out[n]`` (its row to ``rep_out[n]``), the index into ``rows`` of each row that moved to
    ``moved_out[m]``. Returns (n, m), or (DECLINED, 0) when a count would fall below zero or a row
    would skip its last block (bugs: the state is then partly changed, and the caller asserts)."""
    n = 0
    m = 0
    for i in range(rows.size):
        row = rows[i]
        nb = num_blocks[row]
        skip = _window_skip(num_computed[i], window, block_size, nb)
        start = num_skipped[row]
        if skip <= start:
            continue
        if skip >= nb:  # never the last block: kvd.manager's _Group keeps last_block
            return DECLINED, 0
        for j in range(skip - 1, start - 1, -1):
            b = table[row, j]
            table[row, j] = NULL_BLOCK
            if b == NULL_BLOCK:
                continue
            if ref_cnt[b] <= 0:
                return DECLINED, 0
            ref_cnt[b] -= 1
            if ref_cnt[b] == 0:
                freed_out[n] = b
                rep_out[n] = row
                n += 1
        num_skipped[row] = skip
        moved_out[m] = i
        m += 1
    return n, m


@_jit
def park_blocks(freed, cache_key, no_cache_key, stack, stack_top, qbuf, qtail, queue_pos, evict_prio, prio):
    """Blocks whose count just reached zero, in freeing order (what ``BlockPool.park`` does with one
    priority for all): a block in no prefix cache goes on the free stack (``stack[stack_top]``), a
    cached one to the tail of the eviction queue (``qbuf[qtail]``, its position in ``queue_pos``,
    ``prio`` in ``evict_prio``). The caller made room for every block in both. Returns (new
    stack_top, new qtail)."""
    for i in range(freed.size):
        b = freed[i]
        if cache_key[b] == no_cache_key:
            stack[stack_top] = b
            stack_top += 1
        else:
            qbuf[qtail] = b
            queue_pos[b] = qtail
            evict_prio[b] = prio
            qtail += 1
    return stack_top, qtail


@_jit
def pop_queue(buf, head, queue_pos, evict_prio, prio, k, out, o):
    """Take the ``k`` oldest live entries of an eviction queue (``kvd.pool._EvictionQueue``: an
    entry at index i is live when its block's ``queue_pos`` is i and its ``evict_prio`` is
    ``prio``; the caller knows k are live) into ``out[o:o + k]``, marking each block out of every
    queue (``queue_pos`` -1). Returns the new head: just past the last entry taken."""
    i = head
    n = 0
    while n < k:
        b = buf[i]
        if queue_pos[b] == i and evict_prio[b] == prio:
            out[o + n] = b
            queue_pos[b] = -1
            n += 1
        i += 1
    return i


@_jit
def sync_appended_rows(mrows, owner_sid, owner_srow, sid, table, counts, last_block, out_table, out_counts,
                       dirty_start, dirty_end, srows_out, whole=False):
    """Publish rows after appends without copy-on-write to a group without a sliding window (its
    tables only grow at their ends): for each of ``mrows`` that session ``sid`` owns, copy the
    entries from its published count to its new one into its session row of ``out_table``, and the
    count. ``whole``: a sliding window's group, whose released entries at the front became
    NULL_BLOCK: of the published entries, those that differ are written too, and the changed range
    starts at the first of them. (Comparing costs a read where copying cost a write; and a GPU
    mirror's tracker gets the entries a window released, not the whole row: a decode step of 256
    requests whose windows slid by a block each marked every row's every entry.) Entries from the
    published count on are written and marked whatever they hold: the shared row may hold what a
    row's earlier request left there, which the GPU copy never received. A row that grew by one block publishes it from ``last_block`` (the group's dense array),
    not from its table row: at 4,096 requests every row grows on the same step, and each table row
    is a cache line (and often a page) of its own. ``dirty_start``/``dirty_end`` (empty: none) widen
    each session row's range of entries changed (a GPU mirror's tracker). Returns how many rows it
    published; their session rows are at the front of ``srows_out``."""
    k = 0
    track = dirty_start.size > 0
    for i in range(mrows.size):
        m = mrows[i]
        if owner_sid[m] != sid:
            continue
        s = owner_srow[m]
        new = counts[m]
        old = out_counts[s]
        lo = old if new >= old else 0  # a row that shrank (not expected here) is copied whole
        first = lo  # the first entry changed
        if whole:
            for j in range(lo):
                v = table[m, j]
                if out_table[s, j] != v:
                    out_table[s, j] = v
                    if j < first:
                        first = j
        if new == lo + 1:
            out_table[s, lo] = last_block[m]
        else:
            for j in range(lo, new):
                out_table[s, j] = table[m, j]
        if track and new > first:
            if first < dirty_start[s]:
                dirty_start[s] = first
            if new > dirty_end[s]:
                dirty_end[s] = new
        out_counts[s] = new
        srows_out[k] = s
        k += 1
    return k


@_jit
def range_slots(table, num_blocks, last_block, block_size, rows, start, lens, pad, pad_end, out):
    """The slots of ``lens[i]`` tokens from position ``start[i]`` of each request (table row
    ``rows[i]``), laid out in request order in ``out``, then ``pad`` up to ``pad_end``: kvd_kernels'
    ``slot_mapping_from_ranges_ref`` for one group, in one call. Returns the number of tokens.

    Positions in a row's last block (a decode step's every token, without lookahead) read the
    block from ``last_block`` (kvd.manager's _Group): one small dense array instead of one table
    entry per row, each on a cache line (and at 4,096 rows a page) of its own. Measured on the
    bench's tables at 4,096 decode rows, 2-core box: 22-25 -> 13 us, 101 -> 29 us with the caches
    flushed between steps. Every scheduled position has its block, so none lies past the last one."""
    t = 0
    for i in range(rows.size):
        row = rows[i]
        first_of_last = np.int64(num_blocks[row] - 1) * block_size
        last_base = np.int64(last_block[row]) * block_size - first_of_last
        if lens[i] == 1 and start[i] >= first_of_last:  # a decode token: no inner loop (~30 % faster)
            out[t] = last_base + start[i]
            t += 1
            continue
        for p in range(start[i], start[i] + lens[i]):
            if p >= first_of_last:
                out[t] = last_base + p
            else:
                out[t] = np.int64(table[row, p // block_size]) * block_size + p % block_size
            t += 1
    for j in range(t, pad_end):
        out[j] = pad
    return t


@_jit
def slot_inputs(srows, start, lens, req_rows, qsl, positions):
    """``kvd.gpu_session.stage_slot_inputs`` (its numpy reference) in one call: per scheduled request
    its session row into ``req_rows[:B]``, the running token count into ``query_start_loc[:B+1]``,
    each token's position into ``positions`` (the first ``len(positions)`` tokens). Returns B."""
    B = srows.size
    qsl[0] = 0
    t = 0
    cap = positions.size
    for i in range(B):
        req_rows[i] = srows[i]
        for j in range(lens[i]):
            if t + j < cap:
                positions[t + j] = start[i] + j
        t += lens[i]
        qsl[i + 1] = t
    return B


@_jit
def stage_changes(st, en, g, table, groups, rows, starts, offsets, ids, n, k, big):
    """One group's part of ``ChangeTracker.stage`` (kvd.gpu_session, whose numpy loop is the
    reference): every row r whose recorded region [st[r], en[r]) is not empty becomes change n
    (group g, row r, start st[r], ``offsets[n + 1]`` the end of its ids), its entries of ``table``
    appended to ``ids`` from k; the region is reset (``big``, 0). Returns the new (n, k)."""
    for r in range(st.size):
        s, e = st[r], en[r]
        if e > s:
            groups[n] = g
            rows[n] = r
            starts[n] = s
            for j in range(s, e):
                ids[k] = table[r, j]
                k += 1
            offsets[n + 1] = k
            n += 1
            st[r] = big
            en[r] = 0
    return n, k


@_jit
def confirm_in_place(blocks, sizes, regs, keys, block_reg, unconfirmed_by, cache_key):
    """Confirm registrations whose blocks sit in their shared map: entry e is ``sizes[e]`` blocks
    of ``blocks`` (in order), registered as ``regs[e]`` by side key ``keys[e]``. A block still cached
    by that very registration (``block_reg``) and still unconfirmed by that key becomes confirmed
    (``unconfirmed_by`` 0). Returns how many, or DECLINED, having changed nothing, when one of them
    lives in the side map instead (moving it is the pool's business)."""
    pos = 0
    for e in range(sizes.size):
        reg, key = regs[e], keys[e]
        for j in range(pos, pos + sizes[e]):
            b = blocks[j]
            if block_reg[b] == reg and unconfirmed_by[b] == key and cache_key[b] == key:
                return DECLINED
        pos += sizes[e]
    n = 0
    pos = 0
    for e in range(sizes.size):
        reg, key = regs[e], keys[e]
        for j in range(pos, pos + sizes[e]):
            b = blocks[j]
            if block_reg[b] == reg and unconfirmed_by[b] == key:
                unconfirmed_by[b] = 0
                n += 1
        pos += sizes[e]
    return n


@_jit
def next_blocks(rows, counts, stop, namespace, table, num_blocks, last_block, num_registered, cache_key,
                out_blocks, out_rows, out_ns):
    """The blocks the first ``stop`` requests of a decode step filled, when each filled at most
    one (``counts`` 0 or 1), all of those are of one namespace (written to ``out_ns[0]``) and none
    of their blocks is cached yet: per request of count 1, in order, its next block to register and
    its row. Returns how many, or DECLINED, having changed nothing, when any of that does not hold
    or there are more than ``out_blocks.size`` (the general path then decides block by block).
    The block that filled is usually the row's last (no block added since): read from the dense
    ``last_block``, not the table row (a cache line, and often a page, of its own per row)."""
    ns = -1
    k = 0
    for i in range(stop):
        c = counts[i]
        if c == 0:
            continue
        row = rows[i]
        if c != 1 or k == out_blocks.size or (ns >= 0 and namespace[row] != ns):
            return DECLINED
        ns = namespace[row]
        j = num_registered[row]
        b = last_block[row] if j == num_blocks[row] - 1 else table[row, j]
        if b == 0 or cache_key[b] != 0:
            return DECLINED
        out_blocks[k] = b
        out_rows[k] = row
        k += 1
    out_ns[0] = ns
    return k


@_jit
def add_one(counts, rows, n):
    """``counts[rows[i]] += 1`` for the first ``n`` rows (distinct): numpy's fancy ``+=`` gathers,
    adds and scatters in three passes over rows that are cache misses at scale."""
    for i in range(n):
        counts[rows[i]] += 1


@_jit
def gather_rows(mapping, rows, out):
    """``out[i] = mapping[rows[i]]``, every row checked to lie in ``[0, mapping.size)``: -1 when
    all did, else the index of the first that did not (``out`` then partly written). numpy's
    ``take`` with a range check converts the indexes to intp in a pass of their own first."""
    n = mapping.size
    for i in range(rows.size):
        r = rows[i]
        if r < 0 or r >= n:
            return i
        out[i] = mapping[r]
    return -1


@_jit
def count_unheld(ref_cnt, blocks):
    """How many of ``blocks`` nobody holds (free cached blocks a hit would revive)."""
    n = 0
    for i in range(blocks.size):
        if ref_cnt[blocks[i]] == 0:
            n += 1
    return n


@_jit
def hold_blocks(blocks, ref_cnt, queue_pos, evict_prio, per_prio):
    """One reference more on each of ``blocks`` (unique ids); one nobody held leaves its eviction
    queue (``queue_pos`` -1: a tombstone) and is counted in ``per_prio`` at its priority. Returns
    how many that was (what ``kvd.pool.BlockPool.touch`` does with three gathers and a bincount)."""
    n = 0
    for i in range(blocks.size):
        b = blocks[i]
        if ref_cnt[b] == 0:
            queue_pos[b] = -1
            per_prio[evict_prio[b]] += 1
            n += 1
        ref_cnt[b] += 1
    return n


@_jit
def widen_counts(counts, out):
    """``out[:] = counts`` (int32 hash counts into int64; ``out`` empty: only the total) and their
    total, or -1 as soon as one is negative (``out`` then partly written): a registering decode
    step's counts checked and widened in one pass, where numpy takes a casting reduction (~3-20 µs
    at 4,096 counts in the daemon's cache state) and a cast. int32 counts cannot overflow the total."""
    keep = out.size > 0
    total = 0
    for i in range(counts.size):
        c = counts[i]
        if c < 0:
            return -1
        if keep:
            out[i] = c
        total += int(c)  # (as plain Python, NUMBA_DISABLE_JIT=1: numpy int32 arithmetic would wrap)
    return total


def widened_counts(counts: np.ndarray, keep: bool = True) -> tuple[np.ndarray, int]:
    """int32 ``counts`` as a new int64 array (``keep``; else an empty one) and their total (-1: one
    is negative, and the array is not to be used): ``widen_counts``, or numpy without numba."""
    out = np.empty(counts.size if keep else 0, np.int64)
    if HAVE_NUMBA:
        return out, int(widen_counts(counts, out))
    if keep:
        out[:] = counts
    return out, (-1 if counts.size and int(counts.min()) < 0 else int(counts.sum(dtype=np.int64)))


def map_rows(mapping: np.ndarray, rows: np.ndarray) -> np.ndarray | None:
    """``mapping[rows]`` (int32 rows, a new array), or None when a row lies outside the mapping:
    the compiled ``gather_rows``, else numpy's ``take`` (whose uint32 view of the rows makes a
    negative one out of range too)."""
    if HAVE_NUMBA:
        out = np.empty(rows.size, np.int32)
        return out if gather_rows(mapping, rows, out) < 0 else None
    try:
        return mapping.take(rows.view(np.uint32))
    except IndexError:
        return None


def warm_up_groups(num_groups: int) -> None:
    """``append_batch_groups`` for ``num_groups`` groups (its tuples' length is part of its type)."""
    i32, i64 = np.zeros(1, np.int32), np.zeros(1, np.int64)
    G = num_groups
    table = np.zeros((1, 1), np.int32)
    append_batch_groups(i32, 0, i64[:0], 0, (i64[:0],) * G, 1, i64, np.zeros(1, bool), np.zeros(1, bool), False,
                        i32.copy(), (table,) * G, (i32,) * G, (i32,) * G, (i32,) * G, i32.copy(), np.ones(G, np.int64),
                        i32.copy(), 0, i64.copy(), np.zeros((G, 1), np.int64), np.zeros((G, 1), bool),
                        np.zeros(G, np.int64), np.zeros((1, 2), np.int32), i32.copy(), np.zeros(1, bool))


def warm_up() -> None:
    """Compile (or load from the disk cache) every loop for the manager's array types now, so that
    the first step a daemon serves does not pay for it."""
    i32, i64 = np.zeros(1, np.int32), np.zeros(1, np.int64)
    flags, table = np.zeros(1, bool), np.zeros((1, 1), np.int32)
    plan_appends(i32, 0, i64[:0], 0, i64[:0], 1, i64, flags, flags, False, i32.copy(),
                 table, i32, i32, i32.copy(), 1, i64.copy(), i64.copy(), flags.copy())
    apply_appends(i32[:0], 0, i64[:0], i64, i64, flags, i32, i64.copy(), table, i32, i32.copy(), i32, 1,
                  np.zeros((1, 2), np.int32), i32.copy())
    append_batch(i32, 0, i64[:0], 0, i64[:0], 1, i64, flags, flags, False, i32.copy(),
                 table, i32, i32.copy(), i32, i32.copy(), 1, i32, 0, i64.copy(), i64.copy(), flags.copy(),
                 np.zeros((1, 2), np.int32), i32.copy())
    fork_rows(i32, i32[:0], i64, np.zeros(1, np.uint8), i64, flags, flags, flags.copy(), table, i32, i32.copy(),
              i32, i32, i32, 1)
    share_blocks(i32, i32[:0], table, i32, i32.copy(), i32, i32, i32, i64, 1)
    drop_refs(i32[:0], i32, flags.copy())
    drop_row_refs(table, i32, i32, i32, i32.copy(), i32.copy(), i32.copy(), 0)
    park_blocks(i32[:0], np.zeros(1, np.uint16), 0, i32.copy(), 0, i32.copy(), 0, i32.copy(), np.zeros(1, np.uint8), 1)
    for whole in (False, True):
        sync_appended_rows(i32, i64, i32, 1, table, i32, i32, table.copy(), i32.copy(), i32[:0], i32[:0], i32.copy(),
                           whole)
    range_slots(table, i32, i32, 1, i32, i32, i32, -1, 1, i64.copy())
    slot_inputs(i32, i32, i32, i32.copy(), np.zeros(2, np.int32), i32.copy())
    stage_changes(i32.copy(), i32.copy(), 0, table, i32.copy(), i32.copy(), i32.copy(), i32.copy(), i32.copy(), 0, 0, 1)
    u16 = np.zeros(1, np.uint16)
    confirm_in_place(i32, i64, i64, u16, i64, u16.copy(), u16)
    next_blocks(i32, i64, 1, i64, table, i32, i32, i32, u16, i32.copy(), i32.copy(), i64.copy())
    add_one(i32.copy(), i32, 1)
    gather_rows(i32, i32, i32.copy())
    count_unheld(i32, i32[:0])
    widen_counts(i32, i64.copy())  # counts built in process
    hold_blocks(i32[:0], i32.copy(), i32.copy(), np.zeros(1, np.uint8), i64.copy())
    pop_queue(i32, 0, i32.copy(), np.zeros(1, np.uint8), 0, 0, i32.copy(), 0)
    ro = i32.copy()
    ro.flags.writeable = False
    gather_rows(i32, ro, i32.copy())  # rows straight from a message frame (read-only)
    mirror_appends(table, i32, ro, i32[:0], i32[:0], i32, i64, i64, flags, table, i32, i32, 1)  # the daemon's
    widen_counts(ro, i64.copy())  # hash counts from a frame: compiled later, the first took ~2.7 ms
    range_slots(table, i32, i32, 1, i32, i32, ro, -1, 1, i64.copy())  # a decode op's lengths (protocol.uniform_lens)
    window_slides(i32, i64, 1, 1, i32, i32, table, i32, np.zeros(1, np.uint16))
    warm_up_groups(2)  # (a hybrid model's two groups; other counts load when a manager has them)
    slide_windows(i32[:0], i64, 1, 1, table, i32, i32.copy(), i32.copy(), i32.copy(), i32.copy(), i32.copy())
