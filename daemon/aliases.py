"""Module aliases: extra names for modules (nnsight's `rename=`), and a standard set.

An alias is a name on a *host* module that points at another module of the
tree (usually a descendant): "layers" on the root of GPT-2 points at
"transformer.h". Paths resolve one component at a time, a real child first,
then an alias of the module reached so far, so aliases compose:
"layers.0.attention" is "transformer.h.0.attn".

The standard set gives GPT-2, Llama and BERT-like models the same names
(layers, attention, mlp, final_norm, lm_head, embed), so one graph runs on
all three. On an encoder-decoder (T5, BART, Whisper) `layers`, `final_norm`
and `embed` name the decoder's, the stack whose output the lm_head reads and
that generation steps through; `encoder_layers` and `decoder_layers` name
both stacks, and each block of either has `attention`, `mlp` and (decoder)
`cross_attention`. User renames follow nnsight's rules (a dotted key matched from
every module, `*` components, class keys, dotted aliases); an alias that would
hide a child or another alias is refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nnd.v1 import graph_pb2
from nnd_daemon import errors

if TYPE_CHECKING:  # the control plane imports this module and never torch
    import torch

# alias -> candidate paths relative to the root, first match wins.
_ROOT_STANDARD: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("layers", ("*.h", "*.layers", "*.encoder.layer", "*.decoder.layers", "*.blocks", "*.layer", "*.block")),
    ("final_norm", ("*.ln_f", "*.norm", "*.final_layer_norm", "*.final_layernorm")),
    ("lm_head", ("lm_head", "cls", "embed_out")),
    ("embed", ("*.wte", "*.embed_tokens", "*.embeddings.word_embeddings", "*.word_embeddings", "*.embed_in")),
)
# alias -> candidate paths relative to every layer (the entries of a layer stack), first match
# wins. T5's blocks hold their parts in `layer.<i>`, each wrapped with its norm and residual: the
# aliases name the inner modules, which (like GPT-2's attn and mlp) leave the residual out.
_LAYER_STANDARD: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("attn", "self_attn", "attention", "self_attention", "layer.*.SelfAttention")),
    ("mlp", ("mlp", "feed_forward", "intermediate", "ffn", "layer.*.DenseReluDense")),
    ("cross_attention", ("encoder_attn", "crossattention", "cross_attn", "layer.*.EncDecAttention")),
)
# Encoder-decoders: what the layer stack of an encoder or decoder and the decoder's parts are called.
_STACK_NAMES = ("block", "layers", "layer")
_DECODER_PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("final_norm", ("final_layer_norm", "layer_norm", "norm", "layernorm")),
    ("embed", ("embed_tokens",)),
)


@dataclass(frozen=True)
class Rule:
    """One rename entry: a dotted path key (or a class name) and its aliases."""

    aliases: tuple[str, ...]
    path: str = ""
    type: str = ""


def _join(host: str, name: str) -> str:
    return f"{host}.{name}" if host else name


@dataclass
class AliasTable:
    """host module path -> {alias: target module path}, over one module tree."""

    children: dict[str, list[str]]  # module path -> its child names, in order
    types: dict[str, str]  # module path -> class name
    hosts: dict[str, dict[str, str]] = field(default_factory=dict)

    @classmethod
    def of(cls, model: torch.nn.Module, *, standard: bool = True) -> AliasTable:
        children: dict[str, list[str]] = {}
        types: dict[str, str] = {}
        for path, module in model.named_modules():
            types[path] = type(module).__name__
            children[path] = [name for name, _ in module.named_children()]
        table = cls(children, types)
        if standard:
            table.add_standard()
        return table

    @classmethod
    def of_tree(cls, modules: Iterable[tuple[str, str]], *, standard: bool = True) -> AliasTable:
        """The table of a module tree given as (path, class name) in `named_modules` order: what the
        daemon knows of a model whose module lives in the helper process."""
        children: dict[str, list[str]] = {}
        types: dict[str, str] = {}
        for path, type_name in modules:
            types[path] = type_name
            children.setdefault(path, [])
            if path:
                parent, _, name = path.rpartition(".")
                children.setdefault(parent, []).append(name)
        table = cls(children, types)
        if standard:
            table.add_standard()
        return table

    # ------------------------------------------------------------ resolution

    def step(self, host: str, name: str) -> str | None:
        """The module `name` names from `host`: a real child, else an alias."""
        if name in self.children.get(host, ()):
            return _join(host, name)
        return self.hosts.get(host, {}).get(name)

    def resolve(self, path: str) -> str | None:
        """The real path of a dotted path that may use aliases; None if it names no module."""
        if path in self.types:
            return path
        current = ""
        for name in path.split("."):
            found = self.step(current, name)
            if found is None:
                return None
            current = found
        return current

    def aliases_of(self) -> dict[str, list[str]]:
        """target path -> ["<host>.<alias>", ...] for ModuleInfo.aliases."""
        out: dict[str, list[str]] = {}
        for host, names in self.hosts.items():
            for alias, target in names.items():
                out.setdefault(target, []).append(_join(host, alias))
        return out

    # ------------------------------------------------------------ adding aliases

    def bind(self, host: str, alias: str, target: str, *, strict: bool) -> bool:
        """Name `target` `alias` on `host`. Refused (an error when strict) if that would hide something."""
        current = self.step(host, alias)
        if current == target:
            return True
        if current is not None or not alias.isidentifier():
            if not strict:
                return False
            what = (
                f"the module {current!r}"
                if current is not None
                else "nothing: it is not a valid name (letters, digits, underscores)"
            )
            raise errors.InvalidArgument(
                f"rename: alias {alias!r} for {target!r} on {host or 'the root'!r} would hide {what}; "
                "pick another alias"
            )
        self.hosts.setdefault(host, {})[alias] = target
        return True

    def matches(self, host: str, key: str) -> list[str]:
        """The modules a dotted key (with `*` components) names from `host`."""
        found = [host]
        for part in key.lstrip(".").split("."):
            step: list[str] = []
            for path in found:
                if part == "*":
                    step += [_join(path, child) for child in self.children.get(path, ())]
                    continue
                target = self.step(path, part)
                if target is not None:
                    step.append(target)
            found = step
        return list(dict.fromkeys(found))

    def add_rule(self, rule: Rule) -> int:
        """Apply one rename rule at every module of the tree; returns how many aliases it bound."""
        bound = 0
        for host in list(self.types):
            if rule.type:
                targets = [
                    _join(host, c) for c in self.children.get(host, ()) if self.types[_join(host, c)] == rule.type
                ]
                relatives = [t.rpartition(".")[2] for t in targets]
            else:
                targets = self.matches(host, rule.path)
                relatives = [t[len(host) + 1 :] if host and t.startswith(host + ".") else t for t in targets]
            if not targets:
                continue
            if len(targets) > 1:
                key = rule.type or rule.path
                raise errors.InvalidArgument(
                    f"rename key {key!r} names {len(targets)} modules under {host or 'the root'!r} "
                    f"({', '.join(targets)}); an alias names one module"
                )
            target, relative = targets[0], relatives[0]
            for alias in rule.aliases:
                where = host
                if "." in alias:
                    prefix, _, alias = alias.rpartition(".")
                    if not relative.startswith(prefix + "."):
                        raise errors.InvalidArgument(
                            f"rename alias {prefix + '.' + alias!r} for {target!r}: a dotted alias binds on the "
                            "module its prefix names, so the prefix must start the key's path"
                        )
                    resolved = self.resolve(_join(host, prefix)) if host else self.resolve(prefix)
                    if resolved is None:
                        continue
                    where = resolved
                if self.bind(where, alias, target, strict=True):
                    bound += 1
        return bound

    def add_rules(self, rules: Iterable[Rule]) -> int:
        return sum(self.add_rule(rule) for rule in rules)

    def _one(self, host: str, key: str) -> str | None:
        """The one module `key` names from `host` (None if it names none or several)."""
        targets = [t for t in self.matches(host, key) if t]
        return targets[0] if len(targets) == 1 else None

    def _stack(self, host: str) -> str | None:
        for name in _STACK_NAMES:
            if name in self.children.get(host, ()):
                return _join(host, name)
        return None

    def _add_seq2seq(self) -> list[str]:
        """Aliases of an encoder-decoder's two stacks; returns the stacks it named ([] if none)."""
        # The stacks hang from the root (T5) or from its one child that holds both (BART's `model`).
        for host in ["", *self.children.get("", ())]:
            names = self.children.get(host, ())
            if "encoder" not in names or "decoder" not in names:
                continue
            encoder, decoder = _join(host, "encoder"), _join(host, "decoder")
            enc_stack, dec_stack = self._stack(encoder), self._stack(decoder)
            if enc_stack is None or dec_stack is None:
                continue
            self.bind("", "encoder_layers", enc_stack, strict=False)
            self.bind("", "decoder_layers", dec_stack, strict=False)
            self.bind("", "layers", dec_stack, strict=False)
            for alias, candidates in _DECODER_PARTS:
                part = next((c for c in candidates if c in self.children.get(decoder, ())), None)
                if part is not None:
                    self.bind("", alias, _join(decoder, part), strict=False)
            return [enc_stack, dec_stack]
        return []

    def add_standard(self) -> None:
        stacks = self._add_seq2seq()
        for alias, candidates in _ROOT_STANDARD:
            if self.step("", alias) is not None:
                continue  # named above (an encoder-decoder's) or a real child
            for key in candidates:
                target = self._one("", key)
                if target is not None and self.bind("", alias, target, strict=False):
                    break
        layers = self.step("", "layers")
        for stack in stacks or ([layers] if layers is not None else []):
            for index in self.children.get(stack, ()):
                block = _join(stack, index)
                for alias, keys in _LAYER_STANDARD:
                    for key in keys:
                        target = self._one(block, key)
                        if target is not None:
                            self.bind(block, alias, target, strict=False)
                            break


def rules(renames: Sequence[object]) -> list[Rule]:
    """Rules from `nnd.v1.Rename` messages."""
    out = []
    for r in renames:
        kind = r.WhichOneof("key")  # type: ignore[attr-defined]
        aliases = tuple(a for a in r.aliases if a)  # type: ignore[attr-defined]
        if kind is None or not aliases:
            raise errors.InvalidArgument("a rename entry needs a path or type and at least one alias")
        if kind == "path":
            out.append(Rule(aliases, path=r.path))  # type: ignore[attr-defined]
        else:
            out.append(Rule(aliases, type=r.type))  # type: ignore[attr-defined]
    return out


# ------------------------------------------------------------ rewriting graphs


def rewrite_graph(graph: graph_pb2.Graph, table: AliasTable) -> None:
    """Replace alias paths by real paths, in place (module values and tensors, call_module, caches).

    Paths that resolve to nothing are left alone, so the engine reports them
    as NOT_FOUND naming the client's line."""

    def fix(path: str) -> str:
        real = table.resolve(path) if path else path
        return real if real is not None else path

    for node in graph.nodes:
        kind = node.WhichOneof("kind")
        if kind == "module":
            node.module.path = fix(node.module.path)
        elif kind == "tensor":
            node.tensor.path = fix(node.tensor.path)
        elif kind in ("set", "skip"):
            target = getattr(node, kind).target
            target.path = fix(target.path)
        elif kind == "op" and node.op.name == "call_module" and node.op.args:
            first = node.op.args[0]
            if first.WhichOneof("kind") == "value" and first.value.WhichOneof("kind") == "str":
                first.value.str = fix(first.value.str)
        elif kind == "cache":
            paths = [fix(p) for p in node.cache.modules]
            del node.cache.modules[:]
            node.cache.modules.extend(paths)


def rewrite_graphs(graphs: Iterable[graph_pb2.Graph], table: AliasTable | None) -> None:
    if table is None:
        return
    for graph in graphs:
        rewrite_graph(graph, table)
