"""Blocks written as nnsight 0.8.1 users write them, run unchanged by nnsight
(tests/support/nnsight_blocks_reference.py, in a process of its own) and by nnd
(tests/test_nnsight_compat.py). Each takes a model (nnsight's LanguageModel or
nnd's TransformersModel, same weights) and returns plain results to compare.

Values come back the ways nnsight 0.8 delivers them: `.save()`, `.save()` on
a container made in the block, and containers that live outside the block.
"""

from __future__ import annotations

from typing import Any

import numpy as np

PROMPT = "The Eiffel Tower is in the city of"


def loop_appends_saved(model: Any) -> dict[str, Any]:
    hs = []
    with model.generate(PROMPT, max_new_tokens=3, min_new_tokens=3) as tracer:
        for step in tracer.iter[:]:  # noqa: B007
            hs.append(model.transformer.h[0].output[:, -1].save())
    return {"hs": hs}


def loop_appends_into_an_outer_list(model: Any) -> dict[str, Any]:
    hs = []
    steps = []
    with model.generate(PROMPT, max_new_tokens=3, min_new_tokens=3) as tracer:
        for step in tracer.iter[:]:
            hs.append(model.transformer.h[1].output[:, -1])  # no .save(): the list lives outside the block
            # After the module access: nnsight starts one more pass of an open-ended loop and cuts it
            # at its first module access; nnd runs exactly the steps the generation makes.
            steps.append(step)
    return {"hs": hs, "steps": steps}


def per_step_condition(model: Any) -> dict[str, Any]:
    with model.generate(PROMPT, max_new_tokens=4, min_new_tokens=4) as tracer:
        # Bounded: in nnsight, statements after an open-ended `tracer.iter[:]` loop do not run.
        for step in tracer.iter[0:4]:
            h = model.transformer.h[0].output  # nnsight's loop advances on a module access
            if step == 2:
                h[:, -1] = 0
        ids = tracer.result.save()
    return {"ids": ids}


def branch_on_a_value(model: Any) -> dict[str, Any]:
    with model.trace(PROMPT):
        if model.transformer.h[0].output.norm() > 0:
            model.transformer.h[1].output[:] = 0
        taken = model.lm_head.output.save()
    with model.trace(PROMPT):
        if model.transformer.h[0].output.norm() < 0:
            model.transformer.h[1].output[:] = 0
        not_taken = model.lm_head.output.save()
    return {"taken": taken, "not_taken": not_taken}


def item_format_numpy_outer_dict(model: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with model.trace(PROMPT):  # modules in forward order, as nnsight requires
        out["numpy"] = np.asarray(model.transformer.h[0].output[0, -1].detach())
        out["h"] = model.transformer.h[1].output  # an outer container: delivered without .save()
        logits = model.lm_head.output[0, -1]
        out["item"] = logits.max().item()
        out["tolist"] = logits[:4].tolist()
        out["text"] = f"best={logits.argmax()}"
    return out


def save_on_any_object(model: Any) -> dict[str, Any]:
    with model.trace(PROMPT):
        picks = [].save()
        table = dict().save()
        table["h0"] = model.transformer.h[0].output[0, -1]
        picks.append(model.lm_head.output[0, -1].argmax())
    return {"picks": picks, "table": table}


def sync_inside_generation(model: Any) -> dict[str, Any]:
    norms = []
    with model.generate(PROMPT, max_new_tokens=3, min_new_tokens=3) as tracer:
        for step in tracer.iter[0:3]:
            norm = model.transformer.h[0].output[:, -1].norm().item()
            norms.append(norm)
            if step > 0 and norm > norms[0]:
                model.transformer.h[1].output[:] = 0
        ids = tracer.result.save()
    return {"norms": norms, "ids": ids}


def sync_inside_a_session(model: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with model.session():
        with model.trace(PROMPT):
            h0 = model.transformer.h[0].output  # no save: the next block uses it
        with model.trace(PROMPT):
            norm = model.transformer.h[1].output.norm().item()
            out["norm"] = norm
            if norm > 0:
                model.transformer.h[1].output[:] = h0
            out["logits"] = model.lm_head.output.save()
        with model.trace(PROMPT):
            out["sum"] = model.transformer.h[0].output.sum().item()
    return out


def out_of_order_after_a_sync(model: Any) -> dict[str, Any]:
    try:
        with model.trace(PROMPT):
            model.transformer.h[1].output.sum().item()
            model.transformer.h[0].output[:] = 0
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return {"error": type(exc).__name__}
    return {"error": None}


def with_form_loop_appends_per_step(model: Any) -> dict[str, Any]:
    # nnsight's deprecated `with` form runs its body once per selected step, like the `for` form.
    with model.generate(PROMPT, max_new_tokens=4, min_new_tokens=4) as tracer:
        picks = list().save()
        with tracer.iter[1:3]:
            picks.append(model.lm_head.output[0, -1].argmax(dim=-1))
    with model.generate(PROMPT, max_new_tokens=2, min_new_tokens=2) as tracer:
        by_step = list().save()
        with tracer.all():
            by_step.append([model.transformer.h[0].output[0, -1], model.transformer.h[1].output[0, -1]])
    return {"picks": picks, "by_step": by_step}


def with_form_branch_on_the_step(model: Any) -> dict[str, Any]:
    with model.generate(PROMPT, max_new_tokens=3, min_new_tokens=3) as tracer:
        seen = list().save()
        with tracer.iter[0:3]:
            if len(seen) == 1:  # Python state that changes from one step to the next
                model.transformer.h[0].output[:] = 0
            seen.append(model.transformer.h[1].output[0, -1])
            last = model.lm_head.output[0, -1].save()  # a name the body binds: the last step's value after it
    return {"seen": seen, "last": last}


def model_all_alias(model: Any) -> dict[str, Any]:
    # `model.all()` is nnsight 0.8's deprecated alias of `tracer.all()`.
    with model.generate(PROMPT, max_new_tokens=3, min_new_tokens=3):
        norms = list().save()
        with model.all():
            norms.append(model.transformer.h[1].output[0, -1].norm())
    return {"norms": norms}


def stop_skips_the_rest_of_the_block(model: Any) -> dict[str, Any]:
    after = "never reached"
    with model.trace(PROMPT) as tracer:
        h = model.transformer.h[0].output.save()
        tracer.stop()
        after = "reached"  # not run: stop() ends the block's Python too
    return {"h": h, "after": after}


def session_python_between_blocks(model: Any) -> dict[str, Any]:
    with model.session():
        kept = [].save()  # `.save()` on a plain object outside the session's traces
        for i in range(3):
            if i == 1:
                continue
            with model.trace(PROMPT):
                kept.append(i)
                kept.append(model.transformer.h[1].output[0, -1].sum())
    return {"kept": kept}


def setting_inputs_swaps_them(model: Any) -> dict[str, Any]:
    import torch

    # Setting a module's inputs replaces them: the earlier module's output they alias is left as it was.
    with model.trace(PROMPT):
        before = model.transformer.h[0].output.save()
        model.transformer.h[1].inputs = (torch.zeros_like(model.transformer.h[1].input),) + model.transformer.h[1].inputs[1:]
        model.transformer.h[1].skip(before)
        after = model.transformer.h[1].output.save()
    with model.trace(PROMPT):
        first = model.transformer.h[0].output.save()
        model.transformer.h[1].input = torch.zeros_like(model.transformer.h[1].input)
        logits = model.lm_head.output.save()
    return {"before": before, "after": after, "first": first, "logits": logits}


def calling_the_model_outside_a_block(model: Any) -> dict[str, Any]:
    encoded = model.tokenizer(PROMPT, return_tensors="pt")
    return {"logits": model(**encoded)["logits"]}


def barrier_turns_per_layer(model: Any) -> dict[str, Any]:
    # The activation-patching tutorial's shape: one name rebound per layer in each invoke, a barrier
    # per layer; each layer's patch must use that layer's clean value.
    layers = len(model.transformer.h)
    seen = []  # what each layer computed from the layers patched before it
    with model.trace() as tracer:
        barrier = tracer.barrier(2)
        with tracer.invoke(PROMPT):
            for layer in range(layers):
                clean = model.transformer.h[layer].output[:, -1]
                barrier()
        with tracer.invoke("The Colosseum is in the city of"):
            for layer in range(layers):
                barrier()
                seen.append(model.transformer.h[layer].output[:, -1].clone())
                model.transformer.h[layer].output[:, -1] = clean * (layer + 2)
            logits = model.lm_head.output[:, -1].save()
    return {"logits": logits, "seen": seen}


def barrier_then_each_invoke_reads_its_own(model: Any) -> dict[str, Any]:
    # After a barrier each invoke waits for its next module: the appends land in forward order.
    hs = []
    with model.trace() as tracer:
        barrier = tracer.barrier(2)
        with tracer.invoke(PROMPT):
            a = model.transformer.h[0].output.save()
            barrier()
            hs.append(model.transformer.h[1].output[:, -1] * 2)
        with tracer.invoke("The Colosseum is in the city of"):
            barrier()
            b = model.transformer.h[0].output.save()
            hs.append(model.transformer.h[1].output[:, -1] * 3)
    return {"a": a, "b": b, "hs": hs}


def many_invokes_a_sync_in_one(model: Any) -> dict[str, Any]:
    # 230 short invokes in one trace, and a real value needed inside the fourth of them.
    items = []
    last = []
    with model.trace() as tracer:
        for i in range(230):
            with tracer.invoke(f"Prompt {i} is"):
                h = model.transformer.h[0].output
                if i == 3:
                    items.append(h[0, -1, 0].item())
                if i in (0, 3, 229):
                    last.append(model.lm_head.output[0, -1].save())
    return {"items": items, "last": last}


def session_computes_between_blocks(model: Any) -> dict[str, Any]:
    # Python between a session's blocks computes on an earlier block's values (as the LLM-depth
    # tutorial's sessions do), and a later block uses the result.
    with model.session():
        with model.trace(PROMPT):
            h = model.transformer.h[0].output.save()
        scale = h.norm().save()  # a session's values leave it saved, in nnsight
        delta = (h[:, -1] / scale).save()
        with model.trace(PROMPT):
            model.transformer.h[1].output[:, -1] += delta
            out = model.lm_head.output.save()
    return {"out": out, "scale": float(scale), "delta": delta}


def stop_in_one_invoke_serves_its_sibling(model: Any) -> dict[str, Any]:
    # tracer.stop() in one invoke ends that invoke's body; the sibling parked at the same module is served.
    with model.trace() as tracer:
        with tracer.invoke(PROMPT):
            first = model.transformer.h[0].output.save()
            tracer.stop()
        with tracer.invoke("The Colosseum is in the city of"):
            second = model.transformer.h[0].output.save()
    return {"first": first, "second": second}


def barriers_per_layer_with_items_across_many_invokes(model: Any) -> dict[str, Any]:
    # The activation-patching tutorial's batched cell: one barrier per layer, each met by the clean
    # invoke and one patching invoke per position; every patching invoke needs a real value
    # (`.item()`) and reads names (`layer`, `position`, the per-layer list) the block's own loop
    # rebinds after the invoke was opened.
    layers = len(model.transformer.h)
    positions = [2, 4, 5]
    corrupt = "The Colosseum is in the city of"
    results = []
    with model.trace() as tracer:
        barriers = [tracer.barrier(len(positions) + 1) for _ in range(layers)]
        with tracer.invoke(PROMPT):
            for layer in range(layers):
                hidden = model.transformer.h[layer].output
                barriers[layer]()
            clean = model.lm_head.output[0, -1, 3].save()
        with tracer.invoke(corrupt):
            corrupted = model.lm_head.output[0, -1, 3].save()
        for layer in range(layers):
            row = []
            for position in positions:
                with tracer.invoke(corrupt):
                    barriers[layer]()
                    model.transformer.h[layer].output[:, position, :] = hidden[:, position, :]
                    patched = model.lm_head.output[0, -1, 3]
                    row.append(((patched - corrupted) / (clean - corrupted)).item())
            results.append(row)
        results.save()
    return {"clean": clean, "corrupted": corrupted, "results": results}


def streamer_inside_iter_loops(model: Any) -> dict[str, Any]:
    # nnsight's test_iter_with_streamer1: the streamer's value in each pass of two bounded loops is
    # what transformers handed the streamer then (the prompt's ids at step 0, else the last step's id).
    with model.generate(PROMPT, max_new_tokens=8, min_new_tokens=8) as tracer:
        hs = list()
        hs.save()
        streamed = list()
        streamed.save()
        for step in tracer.iter[0:3]:  # noqa: B007
            streamed.append(model.generator.streamer.output)  # handed over before the step's forward
            hs.append(model.transformer.h[-1].output[:, -1])
        for step in tracer.iter[5:7]:  # noqa: B007
            streamed.append(model.generator.streamer.output)  # handed over before the step's forward
            hs.append(model.transformer.h[-1].output[:, -1])
        ids = tracer.result.save()
    return {"hs": hs, "streamed": streamed, "ids": ids}


def streamer_at_the_top_of_a_generate_block(model: Any) -> dict[str, Any]:
    # Outside any loop the streamer's value is its first one: the prompt's ids (two prompts: both rows).
    with model.generate([PROMPT, PROMPT], max_new_tokens=3, min_new_tokens=3) as tracer:
        streamed = model.generator.streamer.output.save()
        ids = tracer.result.save()
    return {"streamed": streamed, "ids": ids}


def cache_declared_after_a_read_is_refused(model: Any) -> dict[str, Any]:
    # nnsight 0.8: a cache must be declared before the invoke reads or changes a model value.
    found = {}
    for late in (False, True):
        try:
            with model.trace() as tracer:
                with tracer.invoke(PROMPT):
                    if late:
                        model.transformer.h[1].output  # noqa: B018
                    tracer.cache().save()
                    model.transformer.h[0].output  # noqa: B018
            found[f"late={late}"] = "ok"
        except ValueError as e:
            found[f"late={late}"] = f"ValueError: {e}"
    return found


def shapes_read_at_each_generation_step(model: Any) -> dict[str, Any]:
    # Step 0 runs the prompt; each later step one new token: a shape read in the loop is its own step's,
    # and code that indexes with it (the last position) reads that step's row.
    shapes, last, lens = [], [], []
    with model.generate(PROMPT, max_new_tokens=3, min_new_tokens=3) as tracer:
        for step in tracer.iter[0:3]:  # noqa: B007
            h = model.transformer.h[0].output
            shapes.append(list(model.lm_head.output.shape))
            n = h.shape[1]
            last.append(h[:, n - 1].save())
            lens.append(len(h[0]))
    return {"shapes": shapes, "last": last, "lens": lens}


def slices_bounded_by_traced_sizes(model: Any) -> dict[str, Any]:
    # `x.size(d)` is a traced value in nnd (the daemon knows it when it runs): slices bounded by it are built
    # there, at every step of a generation too.
    with model.trace(PROMPT):
        h = model.transformer.h[0].output
        width = h.size(-1)
        inner = model.transformer.h[1].output[:, 1 : h.size(1) - 1 : 2].save()
        head = model.lm_head.output[:, :, :width].save()
    tails = []
    with model.generate(PROMPT, max_new_tokens=3, min_new_tokens=3) as tracer:
        for step in tracer.iter[0:3]:  # noqa: B007
            h = model.transformer.h[0].output
            tails.append(h[:, h.size(1) - 2 :].save())
    return {"inner": inner, "head": head, "tails": tails}


def keyword_inputs_looked_up_by_name(model: Any) -> dict[str, Any]:
    # A module's keyword inputs as the dict they are: membership and .get(), in a trace and at each step.
    missing = []  # a list outside the block: what the body appends stays (a plain str has no .save())
    with model.trace(PROMPT):
        args, kwargs = model.transformer.inputs
        mask = kwargs.get("attention_mask").save() if "attention_mask" in kwargs else None
        missing.append(kwargs.get("no_such_input", "default"))
    found = []
    with model.generate(PROMPT, max_new_tokens=2, min_new_tokens=2) as tracer:
        for step in tracer.iter[0:2]:  # noqa: B007
            args, kwargs = model.transformer.h[0].inputs
            found.append(("attention_mask" in kwargs, "no_such_input" in kwargs))
    return {"mask": mask, "missing": missing, "found": found}


def open_ended_loop_runs_one_pass_past_the_end(model: Any) -> dict[str, Any]:
    # nnsight ends an open `tracer.iter[:]` with one more pass, cut at its first module access: Python
    # before that runs, and the streamer there holds the last token generated.
    steps, streamed, hs = [], [], []
    with model.generate(PROMPT, max_new_tokens=3, min_new_tokens=3) as tracer:
        for step in tracer.iter[:]:
            steps.append(step)
            streamed.append(model.generator.streamer.output.save())
            hs.append(model.transformer.h[0].output[:, -1].save())
    return {"steps": steps, "streamed": streamed, "hs": hs}


def open_ended_loop_pass_past_the_end_rebinds_and_breaks(model: Any) -> dict[str, Any]:
    # The extra pass rebinds names as the loop's own passes do, and a `break` ends it.
    last, passes, seen = -1, 0, []
    with model.generate(PROMPT, max_new_tokens=3, min_new_tokens=3) as tracer:
        for step in tracer.iter[:]:
            last = step
            passes += 1
            model.transformer.h[0].output.save()
    with model.generate(PROMPT, max_new_tokens=3, min_new_tokens=3) as tracer:
        for step in tracer.iter[:]:
            seen.append(step)
            if step == 5:
                break
            model.transformer.h[0].output.save()
    return {"last": last, "passes": passes, "seen": seen}


BLOCKS = {
    f.__name__: f
    for f in (
        loop_appends_saved,
        loop_appends_into_an_outer_list,
        per_step_condition,
        branch_on_a_value,
        item_format_numpy_outer_dict,
        save_on_any_object,
        sync_inside_generation,
        sync_inside_a_session,
        out_of_order_after_a_sync,
        with_form_loop_appends_per_step,
        with_form_branch_on_the_step,
        model_all_alias,
        stop_skips_the_rest_of_the_block,
        session_python_between_blocks,
        setting_inputs_swaps_them,
        calling_the_model_outside_a_block,
        barrier_turns_per_layer,
        barrier_then_each_invoke_reads_its_own,
        many_invokes_a_sync_in_one,
        session_computes_between_blocks,
        stop_in_one_invoke_serves_its_sibling,
        barriers_per_layer_with_items_across_many_invokes,
        streamer_inside_iter_loops,
        cache_declared_after_a_read_is_refused,
        shapes_read_at_each_generation_step,
        slices_bounded_by_traced_sizes,
        keyword_inputs_looked_up_by_name,
        open_ended_loop_runs_one_pass_past_the_end,
        open_ended_loop_pass_past_the_end_rebinds_and_breaks,
    )
}
