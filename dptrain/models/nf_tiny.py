"""``nf_resnet_tiny``: NF-ResNet-50's building blocks (timm's NormFreeNet: ScaledStdConv2d with
learned gains, pre-activation bottlenecks, in-place activations) at a size that trains in
seconds on a CPU — for tests and CPU benchmarks of the NF-ResNet code paths. Registered with
timm, so ``model: {name: timm, timm_name: nf_resnet_tiny}`` builds it."""

from __future__ import annotations

from timm.models import register_model
from timm.models.nfnet import NfCfg, NormFreeNet


@register_model
def nf_resnet_tiny(pretrained: bool = False, **kwargs) -> NormFreeNet:
    if pretrained:
        raise ValueError("nf_resnet_tiny has no pretrained weights")
    # timm's _nfres_cfg (nf_resnet26/50/101) with fewer blocks and channels
    cfg = NfCfg(depths=(1, 1, 1, 1), channels=(32, 64, 128, 256), stem_type="7x7_pool",
                stem_chs=16, bottle_ratio=0.25, act_layer="relu", attn_layer=None)
    # timm's create_model passes its own plumbing (pretrained_cfg, its overlay, cache_dir); every
    # other keyword goes to NormFreeNet, which overlays what it does not take onto cfg, so an
    # unknown one is a TypeError there, as for timm's own NF-ResNets
    plumbing = ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir")
    model = NormFreeNet(cfg, **{k: v for k, v in kwargs.items() if k not in plumbing})
    # what timm's own NF-ResNets carry (build_model_with_cfg sets it): the names of the first
    # convolution and the classifier, by which a weights file is adapted to in_chans and a
    # classifier for other num_classes is initialised afresh (dptrain.models' timm loading)
    model.pretrained_cfg = model.default_cfg = {
        "architecture": "nf_resnet_tiny", "num_classes": model.num_classes,
        "first_conv": "stem.conv", "classifier": "head.fc"}
    return model
