"""Find a model's block list and split the model into ``pre`` + ``blocks`` + ``post``.

A Transformer is seen as ``pre`` (everything that runs before block 0: embeddings, patch
embedding, class tokens), the block list ``blocks[0..L)``, and ``post`` (final norm, pooler,
head). The block list is the container with the most parameters among the
``nn.ModuleList``/``nn.Sequential`` modules whose children (two or more) all have one type,
preferring children made of modules (not a list of ``nn.Linear`` heads) and a list that trains
(not a frozen teacher's); a dotted path overrides the search.

``pre`` and ``post`` are decided by position in the module tree: along the chain of modules
from the root down to the block list, children registered before the chain's next link are
``pre`` and children registered after it are ``post``. Parameters held directly by a module
on that chain (a ViT's ``cls_token`` and ``pos_embed``) are ``pre``. A weight registered after
the block list that the forward reads only before block 0 (MPNet's relative position bias) is
``pre`` too once a training step has shown it (:mod:`~lightning_pipetx.pre_trace`):
:meth:`BlockSplit.with_pre_weights`; and a trainable weight registered before it from which
no block's input is computed (a head assigned before the backbone) is not:
:meth:`BlockSplit.with_post_weights`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from torch import nn


class BlockListNotFoundError(ValueError):
    """Raised when a model has no block list, or the given ``blocks=`` path is not one."""


@dataclass(frozen=True)
class BlockSplit:
    """A model seen as ``pre`` + ``blocks`` + ``post``.

    Attributes:
        root: the module that was searched (a LightningModule or any ``nn.Module``).
        path: dotted path of the block list inside ``root``.
        blocks: the block list itself.
        pre: ``(name, module)`` pairs that run before block 0, by path inside ``root``.
        post: ``(name, module)`` pairs that run after the last block.
        pre_direct_params: ``(name, parameter)`` pairs held directly by a module on the
            chain from ``root`` to the block list; they count as ``pre``.
        pre_by_use: ``(name, parameter)`` pairs registered in ``post`` that the forward reads
            only before block 0; they count as ``pre``.
        post_by_use: ``(name, parameter)`` pairs registered in ``pre`` (or on the chain) from
            which no block's input is computed (a head registered before the backbone); they
            do not count as ``pre``.
        post_modules: ``(name, module)`` pairs of ``pre`` without weights that the forward
            calls only after the last block (a head's dropout); they do not count as ``pre``.
        pre_modules: ``(name, module)`` pairs of ``post`` without weights that the forward calls
            only before block 0 (an embedding dropout registered after the blocks); they freeze
            with the prefix.
    """

    root: nn.Module
    path: str
    blocks: nn.Module
    pre: tuple[tuple[str, nn.Module], ...]
    post: tuple[tuple[str, nn.Module], ...]
    pre_direct_params: tuple[tuple[str, nn.Parameter], ...]
    pre_by_use: tuple[tuple[str, nn.Parameter], ...] = ()
    post_by_use: tuple[tuple[str, nn.Parameter], ...] = ()
    post_modules: tuple[tuple[str, nn.Module], ...] = ()
    pre_modules: tuple[tuple[str, nn.Module], ...] = ()

    def __repr__(self) -> str:
        names = lambda pairs: [name for name, _ in pairs]  # noqa: E731
        return (
            f"BlockSplit(path={self.path!r}, num_blocks={self.num_blocks}, pre={names(self.pre)}, "
            f"post={names(self.post)})"
        )

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def block(self, index: int) -> nn.Module:
        return self.blocks[index]

    def pre_parameters(self) -> Iterator[nn.Parameter]:
        """Parameters of ``pre`` (including those held directly on the chain), each once."""
        seen: set[int] = {id(p) for _, p in self.post_by_use}
        for _, param in self.pre_direct_params + self.pre_by_use:
            if id(param) not in seen:
                seen.add(id(param))
                yield param
        for _, module in self.pre:
            for param in module.parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield param

    def with_pre_weights(self, names: list[str]) -> BlockSplit:
        """This split with the root's parameters ``names`` (registered in ``post``, read only
        before block 0) counted as ``pre``."""
        params = dict(self.root.named_parameters())
        return replace(self, pre_by_use=tuple((name, params[name]) for name in names))

    def with_post_weights(self, names: list[str]) -> BlockSplit:
        """This split with the root's parameters ``names`` (registered in ``pre``, no block's
        input computed from them) not counted as ``pre``."""
        params = dict(self.root.named_parameters())
        return replace(self, post_by_use=tuple((name, params[name]) for name in names))

    def with_post_modules(self, names: list[str]) -> BlockSplit:
        """This split with the modules ``names`` of ``pre`` (without weights, called only after the
        last block) not counted as ``pre``."""
        modules = dict(self.root.named_modules())
        return replace(self, post_modules=tuple((name, modules[name]) for name in names))

    def with_pre_modules(self, names: list[str]) -> BlockSplit:
        """This split with the modules ``names`` of ``post`` (without weights, called only before
        block 0) counted in the frozen prefix."""
        modules = dict(self.root.named_modules())
        return replace(self, pre_modules=tuple((name, modules[name]) for name in names))

    def block_parameters(self, index: int) -> Iterator[nn.Parameter]:
        return self.blocks[index].parameters()

    def trainable_blocks(self, start: int = 0) -> list[int]:
        """Indices of the blocks from ``start`` on that have a trainable weight."""
        return [i for i in range(start, self.num_blocks) if any(p.requires_grad for p in self.blocks[i].parameters())]

    def prefix_modules(self, num_frozen: int) -> list[nn.Module]:
        """``pre`` modules and blocks ``[0, num_frozen)``: what freezing ``num_frozen`` blocks covers."""
        if num_frozen <= 0:
            return []
        pre = [m for _, m in self.pre if self.runs_before_blocks(m)] + [m for _, m in self.pre_modules]
        return pre + [self.blocks[i] for i in range(num_frozen)]

    def runs_before_blocks(self, module: nn.Module) -> bool:
        """Whether ``module`` (of ``pre``) has a weight not found to feed no block, or has no weights
        and was not found to run only after the last block."""
        params, after = list(module.parameters()), {id(p) for _, p in self.post_by_use}
        if not params:
            return all(module is not late for _, late in self.post_modules)
        return not all(id(p) in after for p in params)

    def prefix_parameters(self, num_frozen: int) -> list[nn.Parameter]:
        """Parameters of ``pre`` and blocks ``[0, num_frozen)``.

        A ``pre`` parameter that ``post`` uses too (GPT-2's embedding, tied to its LM head)
        is left out: it is still trained through the head.
        """
        if num_frozen <= 0:
            return []
        read_before = {id(p) for _, p in self.pre_by_use}
        used_later = {id(p) for _, module in self.post for p in module.parameters() if id(p) not in read_before}
        params = [p for p in self.pre_parameters() if id(p) not in used_later]
        for i in range(num_frozen):
            params.extend(self.block_parameters(i))
        return params


def _is_block_list(module: nn.Module) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
        return False
    children = list(module.children())
    first = type(children[0])
    return all(type(child) is first for child in children) and any(True for _ in children[0].parameters())


def block_lists_in_pre(split: BlockSplit) -> list[str]:
    """Paths of other block lists inside ``split``'s ``pre`` (an encoder-decoder's encoder when
    the decoder's layers are the blocks): they freeze whole with the first frozen block."""
    return [
        f"{name}.{inner}" if inner else name
        for name, module in split.pre
        for inner, child in module.named_modules()
        if _is_block_list(child)
        and split.runs_before_blocks(child)
        and any(p.requires_grad for p in child.parameters())
    ]


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _find_block_path(root: nn.Module) -> str | None:
    best: tuple[bool, bool, int, int, int] | None = None
    best_path = None
    for name, module in root.named_modules():
        if not name or not _is_block_list(module):
            continue
        # Blocks are modules of modules (a list of Linear heads is not); then a list that trains
        # wins over one that does not (a frozen teacher's blocks lose to its student's); then most
        # parameters; then more blocks; then the shallower path.
        composite = any(True for _ in module[0].children())
        trains = any(p.requires_grad for p in module.parameters())
        key = (composite, trains, _num_params(module), len(module), -name.count("."))
        if best is None or key > best:
            best, best_path = key, name
    return best_path


def _resolve(root: nn.Module, path: str) -> nn.Module:
    module = root
    for part in path.split("."):
        if not hasattr(module, part):
            raise BlockListNotFoundError(
                f"blocks={path!r}: {type(module).__name__} has no attribute {part!r}. "
                f"Pass the dotted path of the model's block list inside {type(root).__name__}, "
                f"for example blocks='model.bert.encoder.layer'."
            )
        module = getattr(module, part)
    if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 1:
        raise BlockListNotFoundError(
            f"blocks={path!r} points to a {type(module).__name__}, not a non-empty "
            f"nn.ModuleList or nn.Sequential of blocks."
        )
    return module


def _registered_path(root: nn.Module, blocks: nn.Module, path: str) -> str:
    """The name ``root`` registers ``blocks`` under first (``path`` may pass through a property,
    as Hugging Face's ``base_model``, or a second name)."""
    registered = next((name for name, module in root.named_modules() if module is blocks), None)
    if registered is None:
        raise BlockListNotFoundError(
            f"blocks={path!r} is not a submodule of {type(root).__name__} (reached through an attribute that no "
            f"module registers). Pass the path of its registered name, as named_modules() lists it."
        )
    return registered


def find_blocks(root: nn.Module, path: str | None = None) -> BlockSplit:
    """Split ``root`` into ``pre`` + ``blocks`` + ``post``.

    Args:
        root: a LightningModule or any ``nn.Module`` holding the Transformer.
        path: dotted path of the block list inside ``root``; found automatically when None.

    Raises:
        BlockListNotFoundError: no block list was found, or ``path`` does not name one.
    """
    if path is None:
        path = _find_block_path(root)
        if path is None:
            raise BlockListNotFoundError(
                f"Could not find a block list in {type(root).__name__}: no nn.ModuleList or "
                f"nn.Sequential of two or more same-typed children with parameters. Pass its "
                f"dotted path, for example FreezeCallback(blocks='model.encoder.layers') or "
                f"ElasticPipelineStrategy(blocks='model.encoder.layers')."
            )
    blocks = _resolve(root, path)
    path = _registered_path(root, blocks, path)

    pre: list[tuple[str, nn.Module]] = []
    post: list[tuple[str, nn.Module]] = []
    direct: list[tuple[str, nn.Parameter]] = []
    module, prefix = root, ""
    for part in path.split("."):
        direct.extend((prefix + n, p) for n, p in module.named_parameters(recurse=False))
        side = pre
        for name, child in module.named_children():
            if name == part:
                side = post
            else:
                side.append((prefix + name, child))
        module, prefix = getattr(module, part), prefix + part + "."
    return BlockSplit(root, path, blocks, tuple(pre), tuple(_without_aliases(post, pre, blocks)), tuple(direct))


def _without_aliases(
    post: list[tuple[str, nn.Module]], pre: list[tuple[str, nn.Module]], blocks: nn.Module
) -> list[tuple[str, nn.Module]]:
    """``post`` without second names of modules of ``pre`` or of the blocks, or of a module that holds
    the block list (``self.backbone = self.model.bert``, as Lightning's ``BackboneFinetuning`` asks
    for): such a module runs where its first name puts it. (A head holding the embedding module it
    is tied to stays: it holds no block list.)"""
    earlier = {id(m) for _, module in pre for m in module.modules()} | {id(m) for m in blocks.modules()}
    return [
        (name, module)
        for name, module in post
        if id(module) not in earlier and not any(m is blocks for m in module.modules())
    ]
