"""A model's, a dataset's or a task's options (the groups in ddp.config.schema.BUILDERS), checked against
its builder's signature, and the builder called with them.

The builder's own signature is the options' schema. `conf/model/my_net.yaml` names
`_target_: models.my_net.build`, and `def build(num_classes: int, in_channels: int, width: int = 64)`
declares the option `width` and its type. builder_options checks a group's keys against those
parameters and its values against their annotations (through OmegaConf, as a dataclass field), at
startup, before anything runs or is written. So a new model, dataset or task is one module and one
yaml, its options are declared once, where they are used, and a misspelt or mistyped one is a
one-line ConfigError naming it.

Why the signature, and not a dataclass next to the builder: the builder has to declare its
parameters anyway, and a second declaration can drift from it (a field it ignores, a default that
differs).
"""

import dataclasses
import difflib
import inspect
import sys
import typing
from dataclasses import field
from typing import Any

from hydra.errors import InstantiationException
from hydra._internal.utils import _locate
from hydra.utils import instantiate
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ValidationError

from ddp.config.schema import BUILDERS, OPTIONAL_RUN_ARGS, ConfigError


HYDRA_KEYS = ("_target_", "_args_", "_convert_", "_recursive_", "_partial_")  # for instantiate, not the builder


def builder_options(group_cfg: Any, group: str) -> dict:
    """`_target_` and its options from a BUILDERS group's config, checked against the builder's own
    signature: the signature is the options' schema. Every key but the group's own (its schema's) must
    name a parameter of the builder, other than the arguments the run passes it; each parameter without
    a default must be given; and each value must fit its parameter's annotation, converted as OmegaConf
    converts a dataclass field (`int`, `float`, `list[int]`, `str | None`, ...; `Literal[...]` lists the
    allowed values; an annotation OmegaConf can't check, or none, takes any value)."""
    schema, required_args = BUILDERS[group]
    run_args = (*required_args, *OPTIONAL_RUN_ARGS.get(group, ()))
    group_keys = {f.name for f in dataclasses.fields(schema)} - {"_target_"}
    node = group_cfg if isinstance(group_cfg, DictConfig) else OmegaConf.create(group_cfg)
    values = OmegaConf.to_container(node, resolve=True, throw_on_missing=False)
    target = values["_target_"]
    options = {key: value for key, value in values.items() if key not in group_keys and key not in HYDRA_KEYS}
    if target == MISSING:  # validate names it as a missing key
        return options
    try:
        builder = _locate(target)  # what instantiate imports; get_object would also log the error
        parameters = _parameters(builder)
    except (ImportError, AttributeError, NameError, ValueError, TypeError) as error:
        reason = " ".join(str(error).split())
        raise ConfigError(f"{group}._target_={target}: can't be imported or inspected ({reason}); "
                          f"check the module path in conf/{group}/*.yaml") from None
    specials = {key: value for key, value in values.items() if key in HYDRA_KEYS}
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):  # **kwargs: any key is an option
        return {**specials, **options}
    accepted = {name: p for name, p in parameters.items()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name not in run_args}
    not_taken = [name for name in required_args if name not in parameters]
    if not_taken:
        raise ConfigError(f"{group}._target_={target}: must take {', '.join(not_taken)} as keyword arguments "
                          f"(the run passes {', '.join(required_args)}); add them to its parameters")
    for key in options:
        if key in run_args:
            raise ConfigError(f"{group}.{key}: the run passes {key} to {target} itself; remove {group}.{key}")
        if key not in accepted:
            closest = difflib.get_close_matches(key, accepted, n=1)
            hint = f"did you mean {group}.{closest[0]}? " if closest else ""
            raise ConfigError(f"{group}.{key}: unknown key, not an option of {target} ({hint}options: "
                              f"{', '.join(accepted) or 'none'}); check the spelling")
    for name, parameter in accepted.items():
        if name not in options and parameter.default is parameter.empty:
            raise ConfigError(f"{group}.{name} is required: {target} has no default for it; "
                              f"set it in conf/{group}/*.yaml or pass {group}.{name}=<value>")
    annotations = {name: accepted[name].annotation for name in options}
    return {**specials, **_typed_options(options, annotations, group, target)}


def _parameters(builder: Any) -> dict[str, inspect.Parameter]:
    """The builder's parameters with their annotations evaluated, as inspect.signature(eval_str=True)
    does. A postponed annotation (`from __future__ import annotations`) that can't be evaluated at run
    time, such as a name imported only under `if TYPE_CHECKING:`, must not refuse a builder that imports
    fine: that parameter alone is left unannotated (its key takes any value), and the others are checked.
    Raises ValueError or TypeError for a builder inspect can't read."""
    signature = inspect.signature(builder)
    try:
        return dict(inspect.signature(builder, eval_str=True).parameters)
    except Exception:  # whatever eval raised: NameError mostly, also AttributeError, TypeError, SyntaxError
        pass
    namespace = vars(sys.modules[builder.__module__])  # where the builder's annotations were written
    parameters = {}
    for name, parameter in signature.parameters.items():
        if isinstance(parameter.annotation, str):
            try:
                parameter = parameter.replace(annotation=eval(parameter.annotation, namespace))
            except Exception:
                parameter = parameter.replace(annotation=inspect.Parameter.empty)
        parameters[name] = parameter
    return parameters


def _typed_options(options: dict, annotations: dict, group: str, target: str) -> dict:
    """`options` converted to their annotations by OmegaConf, through a dataclass made of them."""
    fields = []
    for name, annotation in annotations.items():
        if typing.get_origin(annotation) is typing.Literal:
            choices, value = typing.get_args(annotation), options[name]
            if not (value == MISSING or value in choices):
                raise ConfigError(f"{group}.{name}={value}: unknown, use one of {', '.join(map(str, choices))}")
        fields.append((name, annotation if _omegaconf_checks(annotation) else Any, field(default=MISSING)))
    typed = OmegaConf.structured(dataclasses.make_dataclass("BuilderOptions", fields))
    try:
        typed = OmegaConf.merge(typed, options)
    except ValidationError as error:
        name = str(error.full_key).split(".")[0].split("[")[0]
        reason = str(error).strip().splitlines()[0]
        raise ConfigError(f"{group}.{error.full_key}: {reason}; {target} takes "
                          f"{name}: {inspect.formatannotation(annotations[name])}") from None
    return OmegaConf.to_container(typed, throw_on_missing=False)


def _omegaconf_checks(annotation: Any) -> bool:
    """Whether OmegaConf can type-check a dataclass field with this annotation."""
    if annotation is inspect.Parameter.empty:
        return False
    try:
        OmegaConf.structured(dataclasses.make_dataclass("probe", [("value", annotation, field(default=MISSING))]))
    except Exception:  # omegaconf raises ValidationError, and others for annotations it doesn't know
        return False
    return True


def instantiate_checked(node: Any, key: str, **kwargs: Any) -> Any:
    """hydra.utils.instantiate, with a value the target rejects turned into a one-line error naming `key`."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as error:
        cause = error.__cause__
        if isinstance(cause, ConfigError):  # the builder's own message
            raise cause from None
        if isinstance(cause, (ValueError, TypeError)):  # e.g. torch.optim's "Invalid weight_decay value"
            raise ConfigError(f"{key}: {cause}") from None
        raise
