"""Compiled (numba) kernels of the byte-level BPE tokenizer; nanoeuler/tokenizer/bpe.py drives them.

Everything works on UTF-8 bytes in a numpy uint8 array, so any byte sequence can be tokenized: a byte that
starts no valid UTF-8 sequence is one character of class OTHER, exactly as Python's 'surrogateescape'
decoding would make it. The jobs:
- `split_pieces`: GPT-2 pretokenization, a hand-written scanner equivalent to the regex
  's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+
- `split_pieces_digits`: the same after `tokenizers`' Digits(individual_digits=True) (SmolLM's rule), and
  `split_pieces_llama3`: Llama 3's Split regex (and Qwen2's, one digit at a time).
- `intern_pieces`: a hash table of distinct pieces; training counts them, encoding caches their tokens.
- `train_merges`: BPE training with incremental pair counts (pair -> count weighted by piece frequency,
  pair -> positions where it occurs, a lazy max-heap), never a recount per merge.
- `bpe_pieces` + `gather`: merge application (lowest merge rank first, leftmost first, with a heap so
  that a megabyte-long run of spaces costs n log n, not n^2) once per distinct piece, then a copy.
Functions are compiled on first use and cached on disk (cache=True), so only the first run pays for it.
"""
import numpy as np
from numba import njit

OTHER, LETTER, NUMBER, SPACE = 0, 1, 2, 3  # values of the class table (unicode_classes.txt)

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)
_FIB = np.uint64(0x9E3779B97F4A7C15)


# ----------------------------------------------------------------------------------------------------
# pretokenization


@njit(cache=True)
def _char(data, i, n, cls):
    """(class, byte length) of the character starting at data[i] (strict UTF-8, as Python decodes it)."""
    b0 = np.int64(data[i])
    if b0 < 0x80:
        return np.int64(cls[b0]), 1
    if b0 < 0xC2 or b0 > 0xF4:
        return np.int64(OTHER), 1
    if b0 < 0xE0:
        if i + 1 < n and 0x80 <= data[i + 1] <= 0xBF:
            return np.int64(cls[((b0 & 0x1F) << 6) | (np.int64(data[i + 1]) & 0x3F)]), 2
        return np.int64(OTHER), 1
    if b0 < 0xF0:
        lo = 0xA0 if b0 == 0xE0 else 0x80  # no overlong forms
        hi = 0x9F if b0 == 0xED else 0xBF  # no surrogates
        if i + 2 < n and lo <= data[i + 1] <= hi and 0x80 <= data[i + 2] <= 0xBF:
            cp = ((b0 & 0x0F) << 12) | ((np.int64(data[i + 1]) & 0x3F) << 6) | (np.int64(data[i + 2]) & 0x3F)
            return np.int64(cls[cp]), 3
        return np.int64(OTHER), 1
    lo = 0x90 if b0 == 0xF0 else 0x80
    hi = 0x8F if b0 == 0xF4 else 0xBF  # nothing above U+10FFFF
    if i + 3 < n and lo <= data[i + 1] <= hi and 0x80 <= data[i + 2] <= 0xBF and 0x80 <= data[i + 3] <= 0xBF:
        cp = (((b0 & 0x07) << 18) | ((np.int64(data[i + 1]) & 0x3F) << 12)
              | ((np.int64(data[i + 2]) & 0x3F) << 6) | (np.int64(data[i + 3]) & 0x3F))
        return np.int64(cls[cp]), 4
    return np.int64(OTHER), 1


@njit(cache=True)
def split_pieces(data, n, cls, ends):
    """Cut data[:n] into GPT-2 pretokens, writing their end offsets to ends; returns how many there are."""
    return _split_gpt2(data, n, cls, ends, False)


@njit(cache=True)
def split_pieces_digits(data, n, cls, ends):
    """GPT-2 pretokens after `tokenizers`' Digits(individual_digits=True): every \\p{N} character is a piece
    of its own, and the GPT-2 regex runs on the text between them (so a space never joins a digit, and a
    whitespace run before a digit is not shortened by \\s+(?!\\S): the text it sees ends there)."""
    return _split_gpt2(data, n, cls, ends, True)


@njit(cache=True)
def _split_gpt2(data, n, cls, ends, digits):
    """The GPT-2 scanner (digits: as split_pieces_digits). The regex alternatives are tried in its order;
    one function with an inline ASCII path, because a call per character or per piece costs more than the
    scanning itself."""
    count = 0
    i = 0
    while i < n:
        b = data[i]
        e = -1
        if b == 39 and i + 1 < n:  # 's 't 'm 'd 're 've 'll (case-sensitive, as in GPT-2)
            b1 = data[i + 1]
            if b1 == 115 or b1 == 116 or b1 == 109 or b1 == 100:
                e = i + 2
            elif i + 2 < n:
                b2 = data[i + 2]
                if (b2 == 101 and (b1 == 114 or b1 == 118)) or (b1 == 108 and b2 == 108):
                    e = i + 3
        if e < 0:
            if b < 0x80:
                c, w = np.int64(cls[b]), 1
            else:
                c, w = _char(data, i, n, cls)
            j = i + w
            if b == 32 and j < n:  # a single space joins the letter/digit/other run that follows it
                b1 = data[j]
                if b1 < 0x80:
                    c1, w1 = np.int64(cls[b1]), 1
                else:
                    c1, w1 = _char(data, j, n, cls)
                if c1 != SPACE and not (digits and c1 == NUMBER):
                    c = c1
                    j += w1
            if digits and c == NUMBER:
                e = j
            elif c != SPACE:  # \p{L}+, \p{N}+ or [^\s\p{L}\p{N}]+
                while j < n:
                    bj = data[j]
                    if bj < 0x80:
                        if cls[bj] != c:
                            break
                        j += 1
                    else:
                        cj, wj = _char(data, j, n, cls)
                        if cj != c:
                            break
                        j += wj
                e = j
            else:
                # \s+(?!\S): a whitespace run gives its last character to a following non-space, so
                # "  word" splits as " ", " word"; one whitespace character before a non-space is \s+.
                last = i
                while j < n:
                    bj = data[j]
                    if bj < 0x80:
                        cj, wj = np.int64(cls[bj]), 1
                    else:
                        cj, wj = _char(data, j, n, cls)
                    if cj != SPACE:
                        if digits and cj == NUMBER:
                            last = j  # the text the regex sees ends at the digit
                        break
                    last = j
                    j += wj
                e = last if j < n and last > i else j
        ends[count] = e
        count += 1
        i = e
    return count


@njit(cache=True)
def _cls_at(data, j, n, cls):
    """(class, byte length) of the character at data[j], or (-1, 0) at the end."""
    if j >= n:
        return np.int64(-1), 0
    b = data[j]
    if b < 0x80:
        return np.int64(cls[b]), 1
    return _char(data, j, n, cls)


@njit(cache=True)
def split_pieces_llama3(data, n, cls, ends, max_digits):
    """Cut data[:n] into the pretokens of Llama 3's Split regex (max_digits 3; Qwen2's, the same with 1):
    (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+
    behaviour Isolated; every character is matched by some alternative, so the pieces cover the text. The
    contractions are case-insensitive as Oniguruma folds them: S, T, ... and U+017F (long s, C5 BF) for s."""
    count = 0
    i = 0
    while i < n:
        b = data[i]
        e = -1
        if b == 39 and i + 1 < n:  # (?i:'s|'t|'re|'ve|'m|'ll|'d)
            b1 = data[i + 1] | 32 if data[i + 1] < 0x80 else data[i + 1]
            if b1 == 115 or b1 == 116 or b1 == 109 or b1 == 100:
                e = i + 2
            elif b1 == 0xC5 and i + 2 < n and data[i + 2] == 0xBF:
                e = i + 3
            elif i + 2 < n and data[i + 2] < 0x80:
                b2 = data[i + 2] | 32
                if (b2 == 101 and (b1 == 114 or b1 == 118)) or (b1 == 108 and b2 == 108):
                    e = i + 3
        if e < 0:
            c, w = _cls_at(data, i, n, cls)
            j = i + w
            if c == LETTER or (c != NUMBER and b != 10 and b != 13 and _cls_at(data, j, n, cls)[0] == LETTER):
                while True:  # [^\r\n\p{L}\p{N}]?\p{L}+
                    cj, wj = _cls_at(data, j, n, cls)
                    if cj != LETTER:
                        break
                    j += wj
                e = j
            elif c == NUMBER:  # \p{N}{1,3}
                k = 1
                while k < max_digits:
                    cj, wj = _cls_at(data, j, n, cls)
                    if cj != NUMBER:
                        break
                    j += wj
                    k += 1
                e = j
            elif c == OTHER or (b == 32 and _cls_at(data, j, n, cls)[0] == OTHER):
                while True:  # ' ?[^\s\p{L}\p{N}]+[\r\n]*'
                    cj, wj = _cls_at(data, j, n, cls)
                    if cj != OTHER:
                        break
                    j += wj
                while j < n and (data[j] == 10 or data[j] == 13):
                    j += 1
                e = j
            else:  # whitespace: \s*[\r\n]+ (to the run's last newline), else \s+(?!\S), else \s+
                newline = i + 1 if b == 10 or b == 13 else -1
                last = i
                while True:
                    cj, wj = _cls_at(data, j, n, cls)
                    if cj != SPACE:
                        break
                    if data[j] == 10 or data[j] == 13:
                        newline = j + 1
                    last = j
                    j += wj
                if newline > 0:
                    e = newline
                else:
                    e = last if j < n and last > i else j
        ends[count] = e
        count += 1
        i = e
    return count


# ----------------------------------------------------------------------------------------------------
# hash tables: open addressing with linear probing, capacity a power of two, never more than half full


@njit(cache=True)
def _minus_ones(n):
    a = np.empty(n, np.int64)
    for k in range(n):
        a[k] = -1
    return a


@njit(cache=True)
def _pair_slot(pair_key, key):
    """Slot of a pair key (left << 32 | right: token ids below 2**31): its slot, or the empty (-1) slot where
    it goes."""
    mask = len(pair_key) - 1
    i = np.int64((np.uint64(key) * _FIB) >> np.uint64(32)) & mask
    while pair_key[i] != key and pair_key[i] >= 0:
        i = (i + 1) & mask
    return i


@njit(cache=True)
def _grow(a, need):
    """a, or a copy with at least `need` elements (capacity doubles, contents kept)."""
    if need <= len(a):
        return a
    b = np.empty(max(need, 2 * len(a)), a.dtype)
    for k in range(len(a)):  # loops, not slice assignments, throughout: they compile several times faster
        b[k] = a[k]
    return b


@njit(cache=True)
def _rehash_bytes(ent_hash, n_ent, capacity):
    slot_hash = np.empty(capacity, np.uint64)
    slot_entry = _minus_ones(capacity)
    mask = capacity - 1
    for t in range(n_ent):
        j = np.int64(ent_hash[t] >> np.uint64(32)) & mask
        while slot_entry[j] >= 0:
            j = (j + 1) & mask
        slot_hash[j] = ent_hash[t]
        slot_entry[j] = t
    return slot_hash, slot_entry


@njit(cache=True)
def intern_pieces(data, ends, n_pieces, state, slot_hash, slot_entry, ent_hash, key_off, key_len, key_buf):
    """Number the pieces data[ends[p-1]:ends[p]] (p < n_pieces) by their entries in a table of distinct
    byte strings, adding the ones it lacks: their bytes go back to back into key_buf, in order of first
    appearance (state = [entries, key bytes used]). Returns the piece ids (int32) and the table's arrays,
    which grow as needed."""
    ids = np.empty(n_pieces, np.int32)
    n_ent = state[0]
    used = state[1]
    s = 0
    for p in range(n_pieces):
        e = ends[p]
        m = e - s
        h, slot, ent = _piece_slot(data, s, e, slot_hash, slot_entry, key_off, key_len, key_buf)
        if ent < 0:
            ent = n_ent
            if n_ent == len(key_off):
                key_off = _grow(key_off, n_ent + 1)
                key_len = _grow(key_len, n_ent + 1)
                ent_hash = _grow(ent_hash, n_ent + 1)
            key_buf = _grow(key_buf, used + m)
            for k in range(m):
                key_buf[used + k] = data[s + k]
            key_off[n_ent] = used
            key_len[n_ent] = m
            ent_hash[n_ent] = h
            slot_hash[slot] = h
            slot_entry[slot] = n_ent
            used += m
            n_ent += 1
            if 2 * n_ent > len(slot_entry):
                slot_hash, slot_entry = _rehash_bytes(ent_hash, n_ent, 2 * len(slot_entry))
        ids[p] = ent
        s = e
    state[0] = n_ent
    state[1] = used
    return ids, slot_hash, slot_entry, ent_hash, key_off, key_len, key_buf


# ----------------------------------------------------------------------------------------------------
# training


@njit(cache=True)
def _heap_push(heap, size, key):
    """Push onto the binary max-heap heap[:size] (room for one more is the caller's job); new size."""
    i = size
    while i > 0:
        p = (i - 1) >> 1
        if heap[p] >= key:
            break
        heap[i] = heap[p]
        i = p
    heap[i] = key
    return size + 1


@njit(cache=True)
def _heap_pop(heap, size):
    """Remove the largest key of the max-heap heap[:size]; (key, new size)."""
    top = heap[0]
    size -= 1
    last = heap[size]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size and heap[c + 1] > heap[c]:
            c += 1
        if heap[c] <= last:
            break
        heap[i] = heap[c]
        i = c
    heap[i] = last
    return top, size


@njit(cache=True)
def _above(c1, k1, c2, k2):
    """Whether heap entry (count c1, pair order k1) comes before (c2, k2): the higher count, then the higher
    order (the smaller left id, then the smaller right id: _pair_order)."""
    return c1 > c2 or (c1 == c2 and k1 > k2)


@njit(cache=True)
def _pairs_push(counts, orders, size, count, order):
    """Push (count, order) onto training's max-heap of pairs counts/orders[:size] (room for one more is the
    caller's job); new size."""
    i = size
    while i > 0:
        p = (i - 1) >> 1
        if not _above(count, order, counts[p], orders[p]):
            break
        counts[i] = counts[p]
        orders[i] = orders[p]
        i = p
    counts[i] = count
    orders[i] = order
    return size + 1


@njit(cache=True)
def _pairs_pop(counts, orders, size):
    """Remove the first entry of the max-heap counts/orders[:size]; (count, order, new size)."""
    top_count, top_order = counts[0], orders[0]
    size -= 1
    last_count, last_order = counts[size], orders[size]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size and _above(counts[c + 1], orders[c + 1], counts[c], orders[c]):
            c += 1
        if not _above(counts[c], orders[c], last_count, last_order):
            break
        counts[i] = counts[c]
        orders[i] = orders[c]
        i = c
    counts[i] = last_count
    orders[i] = last_order
    return top_count, top_order, size


_ID_MAX = 0x7FFFFFFF  # token ids are below 2**31


@njit(cache=True)
def _pair_order(a, b):
    """A pair's place among pairs of equal count, larger first: the smallest left id, then right id."""
    return ((_ID_MAX - np.int64(a)) << 32) | (_ID_MAX - np.int64(b))


@njit(cache=True)
def _rehash_pairs(n_pairs, pair_a, pair_b, capacity):
    pair_key = _minus_ones(capacity)
    pair_idx = np.empty(capacity, np.int32)
    for p in range(n_pairs):
        key = (np.int64(pair_a[p]) << 32) | pair_b[p]
        s = _pair_slot(pair_key, key)
        pair_key[s] = key
        pair_idx[s] = p
    return pair_key, pair_idx


@njit(cache=True, nogil=True)
def train_merges(sym, word_start, word_count, vocab_target, progress):
    """Learn merges until there are vocab_target tokens (256 bytes + merge results) or no pair is left.

    sym (int32): the bytes of all distinct pieces back to back; piece w is sym[word_start[w]:word_start[w+1]]
    and occurs word_count[w] times. Each step merges the most frequent adjacent pair (ties: smallest left
    id, then smallest right id), leftmost occurrence first within a piece, as encoding will. A merge whose
    bytes equal an existing token's yields that token (as the `tokenizers` trainer does), so token strings
    stay distinct. progress[0] is set to the token count after each merge (another thread shows it).
    Returns the merges (left ids, right ids) and the token each makes (int32 arrays)."""
    npos = len(sym)
    nwords = len(word_count)
    nxt = np.empty(npos, np.int32)
    prv = np.empty(npos, np.int32)
    wt = np.empty(npos, np.int64)
    for w in range(nwords):
        s, e = word_start[w], word_start[w + 1]
        for k in range(s, e):
            nxt[k] = k + 1 if k + 1 < e else -1
            prv[k] = k - 1 if k > s else -1
            wt[k] = word_count[w]

    # the tokens' bytes, interned in id order (entry t is token t): finds a merge whose bytes are a token's
    t_state = np.zeros(2, np.int64)
    t_slot_hash, t_slot_entry, t_hash = np.empty(1024, np.uint64), _minus_ones(1024), np.empty(512, np.uint64)
    t_off, t_len, t_buf = np.empty(512, np.int64), np.empty(512, np.int64), np.empty(4096, np.uint8)
    tmp = np.empty(256, np.uint8)
    tmp_ends = np.empty(256, np.int32)
    for t in range(256):
        tmp[t] = t
        tmp_ends[t] = t + 1
    _, t_slot_hash, t_slot_entry, t_hash, t_off, t_len, t_buf = intern_pieces(
        tmp, tmp_ends, np.int64(256), t_state, t_slot_hash, t_slot_entry, t_hash, t_off, t_len, t_buf)

    # pairs: key -> index; per index: tokens, count, head of its list of positions (linked nodes)
    cap = 1 << 16
    pair_a = np.empty(cap, np.int32)
    pair_b = np.empty(cap, np.int32)
    pair_count = np.zeros(cap, np.int64)
    pair_head = _minus_ones(cap)
    pair_key, pair_idx = _rehash_pairs(0, pair_a, pair_b, 2 * cap)
    n_pairs = 0
    node_pos = np.empty(max(npos, 16), np.int32)
    node_next = np.empty(max(npos, 16), np.int32)
    n_nodes = 0
    for k in range(npos):
        j = nxt[k]
        if j < 0:
            continue
        key = (np.int64(sym[k]) << 32) | sym[j]
        s = _pair_slot(pair_key, key)
        if pair_key[s] < 0:
            if n_pairs == len(pair_a):
                pair_a = _grow(pair_a, n_pairs + 1)
                pair_b = _grow(pair_b, n_pairs + 1)
                pair_count = _grow(pair_count, n_pairs + 1)
                pair_head = _grow(pair_head, n_pairs + 1)
            pair_a[n_pairs] = sym[k]
            pair_b[n_pairs] = sym[j]
            pair_count[n_pairs] = 0
            pair_head[n_pairs] = -1
            pair_key[s] = key
            pair_idx[s] = n_pairs
            n_pairs += 1
            if 2 * n_pairs > len(pair_key):
                pair_key, pair_idx = _rehash_pairs(n_pairs, pair_a, pair_b, 2 * len(pair_key))
        p = pair_idx[_pair_slot(pair_key, key)]
        pair_count[p] += wt[k]
        node_pos[n_nodes] = k
        node_next[n_nodes] = pair_head[p]
        pair_head[p] = n_nodes
        n_nodes += 1
    stamp = _minus_ones(len(pair_a))

    heap_count = np.empty(max(n_pairs, 16), np.int64)
    heap_order = np.empty(len(heap_count), np.int64)
    hsize = 0
    for p in range(n_pairs):
        hsize = _pairs_push(heap_count, heap_order, hsize, pair_count[p], _pair_order(pair_a[p], pair_b[p]))

    left = np.empty(max(vocab_target - 256, 1), np.int32)
    right = np.empty(len(left), np.int32)
    results = np.empty(len(left), np.int32)
    n_merges = 0
    n_tok = 256
    positions = np.empty(16, np.int32)
    touched = np.empty(16, np.int32)
    while n_tok < vocab_target and hsize > 0:
        count, order, hsize = _pairs_pop(heap_count, heap_order, hsize)
        a = _ID_MAX - (order >> 32)
        b = _ID_MAX - (order & 0xFFFFFFFF)
        p = pair_idx[_pair_slot(pair_key, (a << 32) | b)]
        if pair_count[p] != count:  # stale entry: counts only fall between pushes
            if pair_count[p] > 0:
                heap_count = _grow(heap_count, hsize + 1)
                heap_order = _grow(heap_order, hsize + 1)
                hsize = _pairs_push(heap_count, heap_order, hsize, pair_count[p], order)
            continue

        # the token this merge makes: an existing one with the same bytes, or a new one
        la, lb = t_len[a], t_len[b]
        tmp = _grow(tmp, la + lb)
        for k in range(la):
            tmp[k] = t_buf[t_off[a] + k]
        for k in range(lb):
            tmp[la + k] = t_buf[t_off[b] + k]
        tmp_ends[0] = la + lb
        ids, t_slot_hash, t_slot_entry, t_hash, t_off, t_len, t_buf = intern_pieces(
            tmp, tmp_ends, np.int64(1), t_state, t_slot_hash, t_slot_entry, t_hash, t_off, t_len, t_buf)
        t_new = ids[0]
        if t_new == n_tok:
            n_tok += 1
        left = _grow(left, n_merges + 1)
        right = _grow(right, n_merges + 1)
        results = _grow(results, n_merges + 1)
        left[n_merges] = a
        right[n_merges] = b
        results[n_merges] = t_new
        n_merges += 1

        # the positions listed for the pair (some stale: checked below)
        m = 0
        node = pair_head[p]
        while node >= 0:
            positions = _grow(positions, m + 1)
            positions[m] = node_pos[node]
            m += 1
            node = node_next[node]
        pair_head[p] = -1

        # room for the pairs and nodes this step can create (at most two per occurrence)
        if n_pairs + 2 * m > len(pair_a):
            need = n_pairs + 2 * m
            pair_a = _grow(pair_a, need)
            pair_b = _grow(pair_b, need)
            pair_count = _grow(pair_count, need)
            pair_head = _grow(pair_head, need)
            stamp = _grow(stamp, need)
        if 2 * (n_pairs + 2 * m) > len(pair_key):
            c2 = len(pair_key)
            while 2 * (n_pairs + 2 * m) > c2:
                c2 *= 2
            pair_key, pair_idx = _rehash_pairs(n_pairs, pair_a, pair_b, c2)
        node_pos = _grow(node_pos, n_nodes + 2 * m)
        node_next = _grow(node_next, n_nodes + 2 * m)
        touched = _grow(touched, 2 * m)
        n_touched = 0

        for t in range(m):
            i = positions[t]
            j = nxt[i]
            if sym[i] != a or j < 0 or sym[j] != b:
                continue
            if a == b:  # in a run "x x x x x", merge from the run's start: "xx xx x", as encoding does
                while prv[i] >= 0 and sym[prv[i]] == a:
                    i = prv[i]
            while True:
                j = nxt[i]
                if sym[i] != a or j < 0 or sym[j] != b:
                    break
                w = wt[i]
                pair_count[p] -= w
                for side in range(2):
                    if side == 0:  # (left neighbour, a) becomes (left neighbour, t_new), listed at its position
                        q = prv[i]
                        if q < 0:
                            continue
                        old = (np.int64(sym[q]) << 32) | a
                        new = (np.int64(sym[q]) << 32) | t_new
                        at = q
                    else:  # (b, right neighbour) becomes (t_new, right neighbour), listed at position i
                        q = nxt[j]
                        if q < 0:
                            continue
                        old = (np.int64(b) << 32) | sym[q]
                        new = (np.int64(t_new) << 32) | sym[q]
                        at = i
                    pair_count[pair_idx[_pair_slot(pair_key, old)]] -= w
                    s = _pair_slot(pair_key, new)
                    if pair_key[s] < 0:
                        pair_a[n_pairs] = new >> 32
                        pair_b[n_pairs] = new & 0xFFFFFFFF
                        pair_count[n_pairs] = 0
                        pair_head[n_pairs] = -1
                        stamp[n_pairs] = -1
                        pair_key[s] = new
                        pair_idx[s] = n_pairs
                        n_pairs += 1
                    q2 = pair_idx[s]
                    pair_count[q2] += w
                    node_pos[n_nodes] = at
                    node_next[n_nodes] = pair_head[q2]
                    pair_head[q2] = n_nodes
                    n_nodes += 1
                    if stamp[q2] != n_merges:
                        stamp[q2] = n_merges
                        touched[n_touched] = q2
                        n_touched += 1
                sym[i] = t_new
                sym[j] = -1
                nxt[i] = nxt[j]
                if nxt[j] >= 0:
                    prv[nxt[j]] = i
                if a != b:
                    break
                i = nxt[i]
                if i < 0:
                    break

        # counts only rose for the touched pairs: give each a heap entry with its final count
        heap_count = _grow(heap_count, hsize + n_touched)
        heap_order = _grow(heap_order, hsize + n_touched)
        for t in range(n_touched):
            q2 = touched[t]
            if pair_count[q2] > 0:
                hsize = _pairs_push(heap_count, heap_order, hsize, pair_count[q2],
                                   _pair_order(pair_a[q2], pair_b[q2]))
        progress[0] = n_tok
    return left[:n_merges], right[:n_merges], results[:n_merges]


# ----------------------------------------------------------------------------------------------------
# encoding


@njit(cache=True)
def merge_table(merges):
    """Pair-key hash table of the merges (left << 32 | right: any token numbers below 2**31): (pair_key,
    pair_rank) for `_pair_slot` lookups."""
    cap = 16
    while cap < 2 * len(merges) + 2:
        cap *= 2
    pair_key = _minus_ones(cap)
    pair_rank = np.empty(cap, np.int32)
    for r in range(len(merges)):
        key = (np.int64(merges[r, 0]) << 32) | merges[r, 1]
        s = _pair_slot(pair_key, key)
        pair_key[s] = key
        pair_rank[s] = r
    return pair_key, pair_rank


@njit(cache=True)
def _rank(pair_key, pair_rank, a, b):
    s = _pair_slot(pair_key, (np.int64(a) << 32) | b)
    return pair_rank[s] if pair_key[s] >= 0 else -1


@njit(cache=True)
def _bpe(data, s, e, byte_tok, pair_key, pair_rank, results, sym, nxt, prv, heap, out, o):
    """Apply the merges to the piece data[s:e], writing its tokens at out[o:]; returns their number.
    Each byte starts as its token byte_tok[byte]; a byte without one (-1) is dropped, as the `tokenizers`
    BPE model drops a character missing from its vocabulary when it has no unk token, and its neighbours
    become adjacent. Lowest rank first, leftmost first among equal ranks (the `tokenizers` BPE model's order)."""
    m = 0
    for k in range(s, e):
        t = byte_tok[data[k]]
        if t >= 0:
            sym[m] = t
            m += 1
    if m == 0:
        return 0
    for k in range(m):
        nxt[k] = k + 1 if k + 1 < m else -1
        prv[k] = k - 1
    hsize = 0
    for k in range(m - 1):
        r = _rank(pair_key, pair_rank, sym[k], sym[k + 1])
        if r >= 0:  # max-heap of -(rank << 32 | position) = min-heap of (rank, position)
            hsize = _heap_push(heap, hsize, -((np.int64(r) << 32) | k))
    while hsize > 0:
        key, hsize = _heap_pop(heap, hsize)
        key = -key
        r = key >> 32
        k = key & 0xFFFFFFFF
        j = nxt[k]
        if sym[k] < 0 or j < 0 or _rank(pair_key, pair_rank, sym[k], sym[j]) != r:
            continue  # stale: the pair at k changed since this entry was pushed
        sym[k] = results[r]
        sym[j] = -1
        nxt[k] = nxt[j]
        if nxt[j] >= 0:
            prv[nxt[j]] = k
        q = prv[k]
        if q >= 0:
            r2 = _rank(pair_key, pair_rank, sym[q], sym[k])
            if r2 >= 0:
                hsize = _heap_push(heap, hsize, -((np.int64(r2) << 32) | q))
        q = nxt[k]
        if q >= 0:
            r2 = _rank(pair_key, pair_rank, sym[k], sym[q])
            if r2 >= 0:
                hsize = _heap_push(heap, hsize, -((np.int64(r2) << 32) | k))
    c = 0
    k = 0
    while k >= 0:
        out[o + c] = sym[k]
        c += 1
        k = nxt[k]
    return c


@njit(cache=True, inline="always")
def _piece_slot(data, s, e, slot_hash, slot_entry, key_off, key_len, key_buf):
    """(hash, slot, entry) of data[s:e] in a table of intern_pieces: its entry's slot, or the free slot where
    it would go with entry -1."""
    m = e - s
    # FNV-1a, then a final mix: the slot comes from the high bits, which FNV leaves weak
    h = _FNV_OFFSET
    for k in range(s, e):
        h = (h ^ np.uint64(data[k])) * _FNV_PRIME
    h = (h ^ (h >> np.uint64(32))) * _FIB
    h = h ^ (h >> np.uint64(29))
    mask = len(slot_entry) - 1
    slot = np.int64(h >> np.uint64(32)) & mask
    while True:
        ent = slot_entry[slot]
        if ent < 0:
            return h, slot, -1
        if slot_hash[slot] == h and key_len[ent] == m:
            o = key_off[ent]
            k = 0
            while k < m and key_buf[o + k] == data[s + k]:
                k += 1
            if k == m:
                return h, slot, ent
        slot = (slot + 1) & mask


@njit(cache=True)
def find_piece(data, s, e, slot_hash, slot_entry, key_off, key_len, key_buf):
    """The entry of data[s:e] in a table of intern_pieces (same hash), or -1."""
    return _piece_slot(data, s, e, slot_hash, slot_entry, key_off, key_len, key_buf)[2]


@njit(cache=True)
def bpe_pieces(key_buf, key_off, key_len, first, last, byte_tok, pair_key, pair_rank, results, whole, v_hash,
               v_entry, v_off, v_len, v_buf, tok_off, tok_len, tok_buf, tok_used):
    """Encode the interned pieces first..last-1 (see intern_pieces): piece t's tokens go to
    tok_buf[tok_off[t]:tok_off[t] + tok_len[t]], after the tok_used already there. With `whole`
    (`ignore_merges`), a piece that is itself a token (an entry of the table v_*: entry = token) is that one
    token, unmerged. Returns the (grown) arrays and the new tok_used."""
    tok_off = _grow(tok_off, last)
    tok_len = _grow(tok_len, last)
    ws = 64
    sym = np.empty(ws, np.int32)
    nxt = np.empty(ws, np.int32)
    prv = np.empty(ws, np.int32)
    heap = np.empty(3 * ws, np.int64)
    for t in range(first, last):
        m = key_len[t]
        if m > ws:
            ws = 2 * m
            sym = np.empty(ws, np.int32)
            nxt = np.empty(ws, np.int32)
            prv = np.empty(ws, np.int32)
            heap = np.empty(3 * ws, np.int64)
        tok_buf = _grow(tok_buf, tok_used + m)
        c = -1
        if whole:
            v = find_piece(key_buf, key_off[t], key_off[t] + m, v_hash, v_entry, v_off, v_len, v_buf)
            if v >= 0:
                tok_buf[tok_used] = v
                c = 1
        if c < 0:
            c = _bpe(key_buf, key_off[t], key_off[t] + m, byte_tok, pair_key, pair_rank, results, sym, nxt, prv,
                     heap, tok_buf, tok_used)
        tok_off[t] = tok_used
        tok_len[t] = c
        tok_used += c
    return tok_off, tok_len, tok_buf, tok_used


@njit(cache=True)
def gather(ids, tok_off, tok_len, tok_buf):
    """The tokens of the pieces ids, one after another (int32)."""
    total = 0
    for p in range(len(ids)):
        total += tok_len[ids[p]]
    out = np.empty(total, np.int32)
    o = 0
    for p in range(len(ids)):
        t = ids[p]
        for k in range(tok_len[t]):
            out[o + k] = tok_buf[tok_off[t] + k]
        o += tok_len[t]
    return out
