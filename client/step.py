"""The general ``step`` message of the client: building it and reading its reply.

One error channel per call: a request of the batch that the client can already judge bad (an
unknown id to free, append or fork from, a child or admission id that exists, no free session row,
bad hashes, an append count below 0 or past ``P.MAX_COUNT``) gets that error's code in its status
array, exactly as the daemon (and the in-process manager) reports the requests it judges; the rest
of the batch is sent and applied. Only a malformed batch as a whole (an ``append_rows`` row out of
range, rows or counts that are not integers, mismatched array lengths) raises.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from typing import Any

import numpy as np

from kvd import protocol as P
from kvd.api import STATUS_OK, StepBatch, StepResult, int_array
from kvd.errors import InvalidArgument, KvdError, ProtocolError, UnknownRequest

_EMPTY_I32 = np.empty(0, np.int32)
_EMPTY_I16 = P.EMPTY_I16_RO
_EMPTY_U64 = np.empty(0, np.uint64)
_NO_FORKS = np.empty((0, 2), np.int32)


def tag_of(req_id: Hashable) -> int:
    """The 64-bit tag the daemon publishes for a request id (its row -> tag map in shm)."""
    if type(req_id) is int and 0 < req_id < (1 << 63):
        return req_id
    d = hashlib.blake2b(repr(req_id).encode(), digest_size=8).digest()
    return int.from_bytes(d, "little") or 1


_MAX_TOKEN_ID = (1 << 31) - 1  # token ids travel as int32
BINARY_ADMIT = True
"""``LoneAdmission`` sends the binary ``admit`` op (else the same step as a JSON ``step``; tests compare)."""
BINARY_DECODE_FREE = True
"""``DecodeWithFrees`` sends the binary ``decode_free`` op (else the general JSON ``step``; tests compare)."""


def token_frame(ids) -> bytes:
    """Token ids -> an int32 frame; InvalidArgument for anything but integers in int32's range
    (never a silent cast)."""
    arr = np.asarray(ids)
    if arr.size and (arr.dtype.kind not in "iu" or int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN_ID):
        raise InvalidArgument(f"token ids must be integers in [0, {_MAX_TOKEN_ID}]")
    return np.ascontiguousarray(arr, np.int32).tobytes()


def group_token_ids(token_ids, num_groups: int) -> list:
    """``StepBatch.append_token_ids`` (or ``new_block_token_ids``) as one array-like per group:
    with one group the ids themselves may be given, flat or one row per block."""
    per_group = isinstance(token_ids, (list, tuple)) and all(isinstance(t, (np.ndarray, list, tuple)) for t in token_ids)
    if num_groups == 1 and not (per_group and len(token_ids) == 1):
        return [token_ids]
    if not per_group or len(token_ids) != num_groups:
        raise InvalidArgument(f"token ids must be given for all {num_groups} groups")
    return list(token_ids)


def count_without_appends(count: int) -> int:
    """The header's ``an`` (the append token count) of a step without appends: in process any int
    goes there, so one that the header cannot carry is sent as 1."""
    return int(count) if 0 <= count <= P.MAX_COUNT else 1


def count_field(name: str, value: Any, top: int = P.MAX_COUNT) -> int:
    """A count (or tick) argument for a header, checked on this side, so misuse is InvalidArgument,
    not a ProtocolError: an int in [0, top] (a float is not truncated)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgument(f"{name} must be an integer, got {value!r}")
    if not 0 <= value <= top:
        raise InvalidArgument(f"{name} must be in [0, {top}], got {value}")
    return int(value)


def int32_array(values, what: str) -> np.ndarray:
    """``values`` as a C-contiguous int32 array, or InvalidArgument (``kvd.api.int_array``'s rule:
    an int64 row 2**32 is not row 0)."""
    if type(values) is np.ndarray and values.dtype == np.int32:
        return np.ascontiguousarray(values)
    return np.ascontiguousarray(int_array(values, np.int32, what))


def decode_hash_frames(hashes, counts, n: int, num_groups: int, width: int) -> list[bytes] | None:
    """The decode ops' optional hash frames for ``n`` append rows: none without hashes, each
    group's hashes and counts (in group order) when all are well-typed arrays, None for anything
    else (the step then goes as the general message). Whether the counts add up is the daemon's to
    say (a ProtocolError on either path)."""
    arrays = decode_hash_arrays(hashes, counts, n, num_groups, width)
    return None if arrays is None else [a.tobytes() for a in arrays]


def decode_hash_arrays(hashes, counts, n: int, num_groups: int, width: int) -> list[np.ndarray] | None:
    """``decode_hash_frames`` as the arrays themselves (C-contiguous: a mailbox copies them as they
    are, ``kvd.mailbox``)."""
    if not (len(hashes) or len(counts)):
        return []
    if len(hashes) != num_groups or len(counts) != num_groups:
        return None
    arrays = []
    for hs, cnt in zip(hashes, counts):
        if (type(cnt) is not np.ndarray or cnt.dtype != np.int32 or cnt.shape != (n,)
                or type(hs) is not np.ndarray or hs.ndim != 1 or hs.dtype.itemsize != width or hs.dtype.kind != "S"):
            return None
        arrays += (np.ascontiguousarray(hs), np.ascontiguousarray(cnt))
    return arrays


def _repeats(keys) -> np.ndarray:
    """Per item, whether an earlier item has the same key (unhashable keys never repeat)."""
    seen: set = set()
    out = np.zeros(len(keys), bool)
    for i, k in enumerate(keys.tolist() if isinstance(keys, np.ndarray) else keys):
        try:
            if k in seen:
                out[i] = True
            else:
                seen.add(k)
        except TypeError:
            pass
    return out


def _signed64(tag: int) -> int:
    """A request's uint64 tag as the int64 column it travels in (its two's-complement value)."""
    return tag - (1 << 64) if tag >= 1 << 63 else tag


def _error_code(exc: BaseException) -> int:
    if isinstance(exc, KvdError):
        return exc.code
    return InvalidArgument.code  # an unhashable id, a value of the wrong type


def _spread(local: np.ndarray | None, sent: np.ndarray | None, values: np.ndarray, fill=None) -> np.ndarray:
    """Full per-request array: ``local`` codes (or ``fill``) where the client judged, ``values``
    where sent. ``sent`` None: every request was sent (``_judge``)."""
    if sent is None:
        return values
    out = local.astype(values.dtype) if fill is None else np.full(sent.shape, fill, values.dtype)
    out[sent] = values
    return out


class StepMessage:
    """One general step: frames out, ``StepResult`` (in session rows, whole batch) back."""

    def __init__(self, core: Any, batch: StepBatch, num_groups: int):
        self.core = core
        self.batch = batch
        self.G = num_groups
        self.send_tokens = bool(core.info.get("kv_events"))  # only a daemon that publishes keeps them
        self.new_rows: list[int] = []
        self.unmapped: list[tuple[Hashable, int]] = []  # (id, row) of the requests this step frees

    # ---- building -------------------------------------------------------------------------------
    @staticmethod
    def _judge(items, one) -> tuple[np.ndarray | None, np.ndarray | None, list]:
        """(local status codes, sent mask, results of ``one`` for the sent items); the codes and
        the mask are None when every item is sent (the usual case: no arrays to build or read)."""
        out, errors = [], []
        for i, item in enumerate(items):
            try:
                out.append(one(item))
            except (KvdError, TypeError, ValueError) as e:
                errors.append((i, _error_code(e)))
        if not errors:
            return None, None, out
        local = np.zeros(len(items), np.int16)
        sent = np.ones(len(items), bool)
        for i, code in errors:
            local[i] = code
            sent[i] = False
        return local, sent, out

    def _fork_one(self, pc) -> tuple[int, int, int]:
        p, c = pc
        prow = self.core.row_of(p)
        crow = self.core._new_row(c)
        self.new_rows.append(crow)
        return prow, crow, tag_of(c)

    def _admit_one(self, a) -> tuple[tuple, list[bytes], bytes]:
        per_g = self.core._hashes(a.block_hashes)  # before taking a row: bad hashes take none
        tokens = P.EMPTY
        if a.token_ids is not None and self.send_tokens:  # the ids of its hashed blocks, no more
            need = max(len(h) // self.core.hash_width * bs for h, bs in zip(per_g, self.core.block_sizes))
            tokens = token_frame(a.token_ids)[: 4 * need]
        row = self.core._new_row(a.req_id)
        self.new_rows.append(row)
        return (row, a.num_tokens, a.num_lookahead_tokens, a.priority, a.num_encoder_tokens,
                a.max_new_tokens, 0, tag_of(a.req_id)), per_g, tokens

    def _append_counts(self, ant, app_rows: np.ndarray, num_appends: int, keys) -> tuple[np.ndarray, bytes, int]:
        """(the rows sent, the counts frame (empty: one count for all), that count): an append whose
        count is below 0 or past the wire's MAX_COUNT is the client's InvalidArgument, not sent;
        so then is every repeat of a request (``keys``: each append's row or id) after its first, as
        the manager refuses them whatever the first one's fate (the daemon would otherwise take a
        repeat for the first)."""
        scalar = isinstance(ant, (int, np.integer)) and not isinstance(ant, bool)
        if not num_appends and (scalar or not np.size(ant)):  # (an admission's step: nothing to judge)
            return app_rows, P.EMPTY, count_without_appends(ant) if scalar else 1
        if scalar:
            if 0 <= ant <= P.MAX_COUNT:
                return app_rows, P.EMPTY, int(ant)
            bad = np.ones(num_appends, bool)
        else:
            counts = int_array(ant, np.int64, "append_num_tokens")
            if counts.shape != (num_appends,):
                raise InvalidArgument("append_num_tokens must be an int or have one count per append")
            bad = (counts < 0) | (counts > P.MAX_COUNT)
        if bad.any():
            bad |= _repeats(keys)
            local = self.app_local if self.app_local is not None else np.zeros(num_appends, np.int16)
            sent = self.app_sent if self.app_sent is not None else np.ones(num_appends, bool)
            newly = bad & sent
            local[newly] = InvalidArgument.code
            if self.free_rows.size and sent.all():
                # by row, a request this step frees is unknown by its appends (frees go first); by
                # id, _spec unmapped it before judging them
                local[newly & np.isin(app_rows, self.free_rows)] = UnknownRequest.code
            app_rows = app_rows[~newly[sent]]  # the rows of the appends still sent, in order
            self.app_local, self.app_sent = local, sent & ~bad
        if not scalar:
            sent_counts = counts if self.app_sent is None else counts[self.app_sent]
            return app_rows, sent_counts.astype(np.int32).tobytes(), 0
        return app_rows, P.EMPTY, 0

    def _append_hashes(self, sent: np.ndarray) -> list[bytes]:
        """Per group (hashes, counts) frames of the appends that are sent."""
        b, frames = self.batch, []
        if not (len(b.append_hashes) or len(b.append_hash_counts)):
            return [P.EMPTY, P.EMPTY] * self.G
        for g in range(self.G):
            if len(b.append_hashes) > g and len(b.append_hash_counts) > g:
                hs = P.hashes_frame(b.append_hashes[g], self.core.hash_width)
                cnt = np.ascontiguousarray(b.append_hash_counts[g], np.int32)
                if sent is not None:
                    if cnt.shape[0] != sent.shape[0]:
                        raise InvalidArgument("append_hash_counts must have one count per append")
                    parts = P.split_counts(np.frombuffer(hs, P.HASH_DTYPE), cnt)
                    hs = b"".join(parts[i].tobytes() for i in np.flatnonzero(sent).tolist())
                    cnt = cnt[sent]
                frames += [hs, cnt.tobytes()]
            else:
                frames += [P.EMPTY, P.EMPTY]
        return frames

    def _append_tokens(self, sent: np.ndarray) -> list[bytes]:
        """Per group the token-id frame of the appends that are sent (empty: none given)."""
        b = self.batch
        if not len(b.append_token_ids) or not self.send_tokens:
            return []
        frames = []
        for g, ids in enumerate(group_token_ids(b.append_token_ids, self.G)):
            frame = token_frame(ids)
            if sent is not None and frame:
                if len(b.append_hash_counts) <= g or len(b.append_hash_counts[g]) != sent.shape[0]:
                    raise InvalidArgument("append_token_ids need append_hash_counts, one count per append")
                per_req = np.asarray(b.append_hash_counts[g], np.int64) * (4 * self.core.block_sizes[g])
                ends = np.cumsum(per_req)
                frame = b"".join(frame[e - n : e] for e, n, ok in zip(ends.tolist(), per_req.tolist(), sent) if ok)
            frames.append(frame)
        return frames

    def spec(self) -> tuple:
        try:
            return self._spec()
        except BaseException:
            self.undo()
            raise

    def _judge_frees(self) -> list[int]:
        """Judge the step's frees (``free_local``, ``free_sent``, ``free_rows``) and unmap the ids
        of the ones sent; their rows."""
        core = self.core
        free_ids = list(self.batch.free)
        self.free_local, self.free_sent, free_rows = self._judge(free_ids, core.row_of)
        self.free_rows = np.array(free_rows, np.int32) if free_rows else _EMPTY_I32
        # Frees go first: by the step's forks, appends and admissions the freed requests are gone, so
        # their ids may name a new child or admission and appends of them are unknown (the manager's
        # order). Their rows stay the client's until the reply confirms the frees.
        sent_ids = free_ids if self.free_sent is None else [i for i, s in zip(free_ids, self.free_sent) if s]
        for rid, row in zip(sent_ids, free_rows):
            if core._row_of.get(rid) == row:
                del core._row_of[rid]
                self.unmapped.append((rid, row))
        return free_rows

    def _frees_done(self, free_st: np.ndarray) -> None:
        """The reply's free statuses: the freed rows go, a refused free's request stays."""
        core = self.core
        for r, st in zip(self.free_rows.tolist(), free_st.tolist()):
            if st == STATUS_OK:
                core._drop_row(r)
        for rid, row in self.unmapped:  # a free the daemon refused: that request is still there
            if core._id_of[row] == rid and rid not in core._row_of:
                core._row_of[rid] = row

    def _admission_frames(self, admits: list) -> list[bytes]:
        """The admissions frame (``admit_rows_sent``, ``admit_tokens`` noted) and per group the
        hashes and hash-counts frames of ``_admit_one``'s results."""
        adm = np.array([(*a[0][:6], _signed64(a[0][7])) for a in admits], np.int64).reshape(len(admits), P.ADMIT_COLS)
        self.admit_rows_sent, self.admit_tokens = adm[:, 0].astype(np.int32), adm[:, 1]
        frames = [adm.tobytes()]
        for g in range(self.G):
            frames.append(b"".join(a[1][g] for a in admits))
            frames.append(np.array([len(a[1][g]) // self.core.hash_width for a in admits], np.int32).tobytes())
        return frames

    def _admissions_done(self, adm_st: np.ndarray) -> np.ndarray:
        """The reply's admission statuses: a refused admission's row goes; the admitted rows (-1
        where refused)."""
        bad = adm_st != STATUS_OK
        if not bad.any():
            return self.admit_rows_sent
        for r in self.admit_rows_sent[bad].tolist():
            self.core._drop_row(r)
        return np.where(bad, -1, self.admit_rows_sent).astype(np.int32)

    def _spec(self) -> tuple:
        core, b, G = self.core, self.batch, self.G
        free_rows = self._judge_frees()
        self.fork_local, self.fork_sent, forks = self._judge(list(b.forks), self._fork_one)
        fr = np.array([x[:2] for x in forks], np.int32).reshape(-1, 2) if forks else _NO_FORKS
        tags = np.array([x[2] for x in forks], np.uint64) if forks else _EMPTY_U64
        if b.append_rows is not None:
            app_rows = int32_array(b.append_rows, "append_rows")
            self.app_local = self.app_sent = None
            num_appends = app_rows.shape[0]
        else:
            self.app_local, self.app_sent, rows = self._judge(list(b.append_ids), core.row_of)
            app_rows = np.array(rows, np.int32) if rows else _EMPTY_I32
            num_appends = len(b.append_ids)
        keys = app_rows if b.append_rows is not None else b.append_ids
        app_rows, ant_b, an = self._append_counts(b.append_num_tokens, app_rows, num_appends, keys)
        self.an = an
        fields = {"la": count_field("num_lookahead_tokens", b.num_lookahead_tokens), "nf": len(free_rows),
                  "nk": len(forks), "na": app_rows.shape[0]}
        c = core._confirmation(b.computed_through)
        if c is not None:
            fields["c"] = c
        if not ant_b:
            fields["an"] = an
        frames = [self.free_rows.tobytes(), fr.tobytes() if forks else P.EMPTY, tags.tobytes() if forks else P.EMPTY,
                  app_rows.tobytes(), ant_b]
        frames += self._append_hashes(self.app_sent)
        self.adm_local, self.adm_sent, admits = self._judge(list(b.admit), self._admit_one)
        nd = len(admits)
        fields["nd"] = nd
        frames += self._admission_frames(admits)
        app_tokens = self._append_tokens(self.app_sent)
        if app_tokens or any(a[2] for a in admits):  # the optional token-id frames (kvd.protocol)
            frames.append(b"".join(a[2] for a in admits))
            frames.append(np.array([len(a[2]) // 4 for a in admits], np.int32).tobytes())
            frames += app_tokens or [P.EMPTY] * G
        while len(frames) > 4 and not frames[-1]:
            frames.pop()  # trailing empty frames may be left out
        # The daemon answers in the decode format when only appends with one count travel
        # (kvd.protocol, "Decode step"); read the reply the way it will be written.
        self.decode_reply = not (len(free_rows) or len(forks) or nd or ant_b) and (
            G == 1 or not any(frames[5:]))
        self.app_rows_b = frames[3]
        self.fork_children = fr[:, 1].copy() if forks else _EMPTY_I32
        self.counts = (len(free_rows), len(forks), app_rows.shape[0], nd)
        fields["fl"], body = P.pack_frames(frames)  # one ZeroMQ frame instead of up to 13
        return P.STEP, fields, [body], self.post, self.undo

    def undo(self) -> None:
        for r in self.new_rows:
            self.core._drop_row(r)
        self.new_rows = []
        for rid, row in self.unmapped:
            self.core._row_of[rid] = row
        self.unmapped = []

    # ---- the reply ------------------------------------------------------------------------------
    def post(self, h: dict, f: list) -> StepResult:
        if self.decode_reply:
            from kvd_client.client import _decode_post

            res = _decode_post(self.app_rows_b, self.an, h, f)
            # frees, forks and admissions the client judged bad (nothing of them was sent)
            res.free_status = _spread(self.free_local, self.free_sent, res.free_status)
            res.fork_status = _spread(self.fork_local, self.fork_sent, res.fork_status)
            res.append_status = _spread(self.app_local, self.app_sent, res.append_status)
            res.admit_status = _spread(self.adm_local, self.adm_sent, res.admit_status)
            res.admit_rows = _spread(None, self.adm_sent, res.admit_rows, fill=-1)
            res.admit_cached_tokens = _spread(None, self.adm_sent, res.admit_cached_tokens, fill=0)
            return res
        core = self.core
        nf, nk, na, nd = self.counts
        (free_st, fork_st, app_st, adm_st, cached, copies, changed, freed,
         sched_rows, sched_start, sched_len) = P.split_step_reply(
            f[0], nf, nk, na, nd, h["nc"], h["nch"], h["nfr"], h["ns"])
        self._frees_done(free_st)
        for c, st in zip(self.fork_children.tolist(), fork_st.tolist()):
            if st != STATUS_OK:
                core._drop_row(c)
        admit_rows = self._admissions_done(adm_st) if nd else self.admit_rows_sent
        res = StepResult(
            free_status=_spread(self.free_local, self.free_sent, free_st),
            fork_status=_spread(self.fork_local, self.fork_sent, fork_st),
            append_status=_spread(self.app_local, self.app_sent, app_st),
            admit_status=_spread(self.adm_local, self.adm_sent, adm_st),
            admit_rows=_spread(None, self.adm_sent, admit_rows, fill=-1),
            admit_cached_tokens=_spread(None, self.adm_sent, cached, fill=0),
            copies=copies, changed_rows=changed,
            sched_rows=sched_rows, sched_start=sched_start, sched_len=sched_len,
            freed_rows=freed, tick=h["t"],
        )
        res.num_scheduled_tokens = h.get("nt", [])  # type: ignore[attr-defined]
        return res


class LoneAdmission(StepMessage):
    """:class:`StepMessage` of a lone admission (``StepBatch.is_lone_admission``): the same header fields and
    body bytes, and the same ``StepResult`` from the reply, without the sections it does not carry
    (a new request's time to first token). An admission the client judges bad (bad hashes, a
    duplicate id, no free row) goes the general way, which reports it in its status."""

    def spec(self) -> tuple:
        try:
            one = self._admit_one(self.batch.admit[0])
        except (KvdError, TypeError, ValueError):  # what StepMessage._judge reports as a status
            self.undo()
            return StepMessage(self.core, self.batch, self.G).spec()
        except BaseException:
            self.undo()
            raise
        try:
            return self._lone_spec(one)
        except BaseException:
            self.undo()
            raise

    def _lone_spec(self, one) -> tuple:
        core, b = self.core, self.batch
        cols, per_g, tokens = one
        la = count_field("num_lookahead_tokens", b.num_lookahead_tokens)
        c = core._confirmation(b.computed_through)
        adm = np.array([(*cols[:6], _signed64(cols[7]))], np.int64)
        self.admit_row = cols[0]
        if BINARY_ADMIT:  # the admit op (kvd.protocol): a binary header, no JSON and no section lengths
            frames = [*per_g, tokens] if tokens else list(per_g)
            return P.ADMIT, (P.NO_CONFIRM if c is None else c, la, *adm[0].tolist()), frames, self.post_binary, self.undo
        fields = {"la": la, "nf": 0, "nk": 0, "na": 0}
        if c is not None:
            fields["c"] = c
        fields["an"] = count_without_appends(b.append_num_tokens)
        fields["nd"] = 1
        frames = [P.EMPTY] * (5 + 2 * self.G)
        frames.append(adm.tobytes())
        width = core.hash_width
        for g in range(self.G):
            frames += [per_g[g], np.array([len(per_g[g]) // width], np.int32).tobytes()]
        if tokens:  # the optional token-id frames (kvd.protocol)
            frames += [tokens, np.array([len(tokens) // 4], np.int32).tobytes()]
        while not frames[-1]:
            frames.pop()  # trailing empty frames may be left out (the admission frame never is)
        fields["fl"], body = P.pack_frames(frames)
        return P.STEP, fields, [body], self.post, self.undo

    def post(self, h: dict, f: list) -> StepResult:
        return self._result(f[0], h["nc"], h["nch"], h["nfr"], h["ns"], h["t"], h.get("nt", []))

    def post_binary(self, h, f: list) -> StepResult:
        """The admit op's result: ``h`` a ``P.unpack_decode_reply`` tuple (the blocking client) or
        ``P.parse_reply``'s dict (the asyncio client)."""
        if type(h) is not tuple:
            return self.post(h, f)
        _, _, tick, nc, nch, ns, nt = h
        return self._result(f[0], nc, nch, 0, ns, tick, nt)

    def _result(self, body: bytes, nc: int, nch: int, nfr: int, ns: int, tick: int, nt: list) -> StepResult:
        (_, _, _, adm_st, cached, copies, changed, freed, sched_rows, sched_start, sched_len) = P.split_step_reply(
            body, 0, 0, 0, 1, nc, nch, nfr, ns)
        row = self.admit_row
        if int(adm_st[0]) != STATUS_OK:
            self.core._drop_row(row)
            row = -1
        res = StepResult(
            free_status=_EMPTY_I16, fork_status=_EMPTY_I16, append_status=_EMPTY_I16, admit_status=adm_st,
            admit_rows=np.array([row], np.int32), admit_cached_tokens=cached,
            copies=copies, changed_rows=changed,
            sched_rows=sched_rows, sched_start=sched_start, sched_len=sched_len,
            freed_rows=freed, tick=tick,
        )
        res.num_scheduled_tokens = nt  # type: ignore[attr-defined]
        return res


class DecodeWithFrees(StepMessage):
    """:class:`StepMessage` of frees, appends by row with one token count and admissions (a serving
    engine's step after requests finished and others took their place), or of some of these: the
    binary ``decode_free`` op (kvd.protocol), whose reply is the decode op's with the frees'
    statuses first and the admissions' after the appends'. A step it does not carry goes the
    general way: a free or admission the client judges bad, hashes that are not one well-typed
    array per group, counts out of the wire's range, token ids."""

    def spec(self) -> tuple:
        try:
            spec = self._binary_spec() if BINARY_DECODE_FREE else None
        except BaseException:
            self.undo()
            raise
        return spec if spec is not None else StepMessage(self.core, self.batch, self.G).spec()

    def _binary_spec(self) -> tuple | None:
        core, b = self.core, self.batch
        an, la = b.append_num_tokens, b.num_lookahead_tokens
        if (not 0 <= an <= P.MAX_COUNT or type(la) is not int or not 0 <= la <= P.MAX_COUNT
                or len(b.append_token_ids)):
            return None
        rows = _EMPTY_I32 if b.append_rows is None else int32_array(b.append_rows, "append_rows")
        hash_frames = decode_hash_frames(b.append_hashes, b.append_hash_counts, rows.shape[0], self.G,
                                         core.hash_width)
        if hash_frames is None:
            return None
        self._judge_frees()
        frames = [self.free_rows.tobytes(), rows.tobytes(), *hash_frames]
        nd = len(b.admit)
        if nd and self.free_local is None:  # (after the frees: an id they free may be admitted again)
            frames = self._with_admissions(frames, hash_frames)
        if self.free_local is not None or frames is None:  # the general way reports it in its status
            self.undo()
            return None
        self.nd, self.rows_b, self.an = nd, frames[1], int(an)
        c = core._confirmation(b.computed_through)
        fields = (P.NO_CONFIRM if c is None else c, rows.shape[0], int(an), la, self.free_rows.shape[0], nd)
        return P.DECODE_FREE, fields, frames, self.post_binary, self.undo

    def _with_admissions(self, frames: list[bytes], hash_frames: list[bytes]) -> list[bytes] | None:
        """The op's frames with the step's admissions (rows taken for them), or None when the
        client judges one bad or one carries token ids (the step then goes the general way)."""
        self.adm_local, self.adm_sent, admits = self._judge(list(self.batch.admit), self._admit_one)
        if self.adm_local is not None or any(a[2] for a in admits):
            return None
        return [*frames[:2], *(hash_frames or (P.EMPTY,) * (2 * self.G)), *self._admission_frames(admits)]

    def post_binary(self, h, f: list) -> StepResult:
        """The decode_free op's result: ``h`` a ``P.unpack_decode_reply`` tuple (the blocking
        client) or ``P.parse_reply``'s dict (the asyncio client)."""
        from kvd_client.client import _decode_post

        nf = self.free_rows.shape[0]
        body = f[0]
        if self.nd:
            return self._admitted(h, body, nf)
        if len(body) < 2 * nf:
            raise ProtocolError(f"decode_free reply body of {len(body)} bytes, fewer than {nf} free statuses")
        free_st = np.frombuffer(body, P.I16, nf, 0)
        res = _decode_post(self.rows_b, self.an, h, [memoryview(body)[2 * nf:]])
        self._frees_done(free_st)
        res.free_status = free_st
        res.freed_rows = self.free_rows[free_st == STATUS_OK]
        return res

    def _admitted(self, h, body: bytes, nf: int) -> StepResult:
        """``post_binary`` of a step with admissions: the schedule's rows and lengths are the
        client's to fill in (the appends', then the admissions' whose status is OK)."""
        from kvd_client.client import _EMPTY_COPIES

        if type(h) is tuple:
            _, _, tick, nc, nch, ns, nt = h
        else:
            tick, nc, nch, ns, nt = h["t"], h["nc"], h["nch"], h["ns"], h.get("nt", [])
        na, nd = len(self.rows_b) >> 2, self.nd
        if len(body) != 2 * (nf + na + nd) + 4 * nd + 8 * nc + 4 * nch + 4 * ns:
            raise ProtocolError(f"decode_free reply body of {len(body)} bytes does not match its step")
        free_st = np.frombuffer(body, P.I16, nf, 0)
        app_st = np.frombuffer(body, P.I16, na, 2 * nf)
        adm_st = np.frombuffer(body, P.I16, nd, 2 * (nf + na))
        off = 2 * (nf + na + nd)
        cached = np.frombuffer(body, P.I32, nd, off)
        copies = np.frombuffer(body, P.I32, 2 * nc, off + 4 * nd)
        changed = np.frombuffer(body, P.I32, nch, off + 4 * nd + 8 * nc)
        sched_start = np.frombuffer(body, P.I32, ns, off + 4 * nd + 8 * nc + 4 * nch)
        ok_app, ok_adm = app_st == STATUS_OK, adm_st == STATUS_OK
        sched_rows = np.concatenate([np.frombuffer(self.rows_b, P.I32)[ok_app], self.admit_rows_sent[ok_adm]])
        if sched_rows.shape[0] != ns:
            raise ProtocolError(f"decode_free reply schedules {ns} requests, its statuses {sched_rows.shape[0]}")
        sched_len = np.empty(ns, np.int32)
        appended = ns - int(np.count_nonzero(ok_adm))
        sched_len[:appended] = self.an
        sched_len[appended:] = (self.admit_tokens - cached)[ok_adm]
        self._frees_done(free_st)
        res = StepResult(
            free_status=free_st, fork_status=_EMPTY_I16, append_status=app_st, admit_status=adm_st,
            admit_rows=self._admissions_done(adm_st), admit_cached_tokens=cached,
            copies=copies.reshape(nc, 2) if nc else _EMPTY_COPIES, changed_rows=changed,
            sched_rows=sched_rows, sched_start=sched_start, sched_len=sched_len,
            freed_rows=self.free_rows[free_st == STATUS_OK], tick=tick,
        )
        res.num_scheduled_tokens = nt  # type: ignore[attr-defined]
        return res
