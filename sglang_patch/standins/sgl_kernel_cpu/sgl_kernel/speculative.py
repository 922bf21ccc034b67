"""Plain-torch versions of the ops SGLang's CPU path calls for EAGLE speculative decoding.

Written from what the ops must do, as SGLang's own non-CPU versions of each (Triton kernels in
`sglang/kernels/ops/speculative/` and `cache_move.py`) define it; the signatures are the ones SGLang's
CPU call sites use. They are loops over the batch: a batch here is a few requests on a tiny model."""

import ctypes

import torch


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc) -> None:
    """For every KV buffer (a raw data pointer and a row size in bytes): rows[tgt] = rows[src]."""
    if tgt_loc.numel() == 0:
        return
    rows = int(max(tgt_loc.max(), src_loc.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        # The buffers are SGLang's own CPU tensors; only their addresses travel, as in the CUDA kernel.
        raw = (ctypes.c_uint8 * (rows * int(stride))).from_address(int(ptr))
        buf = torch.frombuffer(raw, dtype=torch.uint8).view(rows, int(stride))
        buf[tgt_loc.long()] = buf[src_loc.long()].clone()


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len,
                                           topk, num_steps) -> None:  # fmt: skip
    """out_cache_loc[b] = the topk * num_steps slots the scheduler reserved after request b's tokens."""
    n = topk * num_steps
    for b, (req, start) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[b * n : (b + 1) * n] = req_to_token[req, start : start + n]


def build_draft_decode_metadata_cpu(req_to_token, req_pool_indices, seq_lens, topk, num_steps, pool_len):
    """A token table with one row per (request, branch): the request's tokens, then the branch's draft slots
    (branch t owns slots [seq_len + t * num_steps, seq_len + (t + 1) * num_steps), as assigned above)."""
    out = torch.zeros((len(seq_lens) * topk, pool_len), dtype=req_to_token.dtype)
    for b, (req, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        for t in range(topk):
            row = out[b * topk + t]
            row[:n] = req_to_token[req, :n]
            row[n : n + num_steps] = req_to_token[req, n + t * num_steps : n + (t + 1) * num_steps]
    return out


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len) -> None:  # fmt: skip
    """Concatenate req_to_token[req, start:end] over the batch into out_cache_loc."""
    at = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        out_cache_loc[at : at + end - start] = req_to_token[req, start:end]
        at += end - start


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc) -> None:
    """The cache slots of the accepted positions (accept_index != -1), packed in order."""
    kept = accept_index.flatten()
    kept = kept[kept != -1]
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept.long()]


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride) -> None:
    """Each request's last accepted token (accept_lens counts it)."""
    flat = accept_tokens.flatten()
    for b, n in enumerate(accept_lens.tolist()):
        bonus_tokens[b] = flat[accept_stride * b + n - 1]


def rotate_input_ids_cpu(input_ids, extend_start_loc, extend_seq_lens, topk_index, select_index) -> None:
    """Shift each request's extend ids left by one and put its new token last (or at select_index)."""
    for b, (start, n) in enumerate(zip(extend_start_loc.tolist(), extend_seq_lens.tolist())):
        if n <= 0:
            continue
        input_ids[start : start + n - 1] = input_ids[start + 1 : start + n].clone()
        last = int(select_index[b]) if select_index is not None else start + n - 1
        input_ids[last] = topk_index.flatten()[b]


def _tree_parents(parent_list, selected, topk):
    """Per node 1..n-1 of one request's tree, the node index of its parent (0 = the root), or None when
    the parent was not among the selected nodes. `selected[i - 1]` names node i in the draft's
    flattened candidate list; its parent is `parent_list[selected[i - 1] // topk]` in the same list."""
    where = {tok: pos + 1 for pos, tok in reversed(list(enumerate(selected)))}
    parents = [None]
    for tok in selected:
        tb = tok // topk
        parents.append(0 if tb == 0 else where.get(parent_list[tb]))
    return parents


FULL_MASK, QLEN_ONLY = 0, 1


def build_tree_kernel_efficient_cpu(parent_list, top_scores_index, seq_lens, tree_mask, positions, retrieve_index,
                                    retrieve_next_token, retrieve_next_sibling, topk, depth, draft_token_num,
                                    tree_mask_mode) -> None:  # fmt: skip
    """The verify tree of each request: its mask rows, positions, and first-child / next-sibling links.

    Node 0 is the last verified token. A node sees itself and its ancestors, at most `depth` of them
    below the root (and, in FULL_MASK mode, the prefix, whose columns the caller fills). Children are
    linked in node order."""
    mode = int(tree_mask_mode)
    if mode not in (FULL_MASK, QLEN_ONLY):
        raise NotImplementedError(f"tree_mask_mode {mode}: eaglenest's CPU stand-in builds FULL_MASK and QLEN_ONLY")
    n = draft_token_num
    pl = parent_list.reshape(len(seq_lens), -1).tolist()
    sel = top_scores_index.reshape(len(seq_lens), -1).tolist()
    mask_at = 0
    for b, prefix in enumerate(seq_lens.tolist()):
        parents = _tree_parents(pl[b], sel[b][: n - 1], topk)
        retrieve_index[b] = torch.arange(b * n, (b + 1) * n)
        for i in range(n - 1, 0, -1):
            p = parents[i]
            if p is not None:
                nxt = int(retrieve_next_token[b, p])
                retrieve_next_token[b, p] = i
                if nxt != -1:
                    retrieve_next_sibling[b, i] = nxt
        width = prefix + n if mode == FULL_MASK else n
        first = prefix if mode == FULL_MASK else 0
        for x in range(n):
            row = mask_at + x * width + first
            tree_mask[row : row + n] = False
            tree_mask[row] = True  # the root
            node, d = x, 0
            for _ in range(depth):  # a node's depth is at most the drafting steps
                if node is None or node == 0:
                    break
                tree_mask[row + node] = True
                d += 1
                node = parents[node]
            positions[b * n + x] = prefix + d
        mask_at += n * width


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index,
                           retrive_next_token, retrive_next_sibling, target_predict) -> None:  # fmt: skip
    """Walk each request's tree from the root, at each level taking the child equal to the target's greedy
    token after the last accepted node. predicts[node] = the target's token there, for every accepted
    node and the bonus one; accept_index lists the accepted nodes (global indices), root first."""
    steps = accept_index.shape[1]
    target = target_predict.flatten()
    for b in range(candidates.shape[0]):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(1, steps):
            cur = int(retrive_next_token[b, cur])
            want = int(target[last])
            while cur != -1 and int(candidates[b, cur]) != want:
                cur = int(retrive_next_sibling[b, cur])
            if cur == -1:
                break
            predicts[last] = want
            accepted += 1
            last = int(retrive_index[b, cur])
            accept_index[b, accepted] = last
        accept_token_num[b] = accepted
        predicts[last] = target[last]
