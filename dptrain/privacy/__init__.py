"""Privacy: the mechanism's randomness and its accounting.

- ``dptrain.privacy.config``: ``PrivacyConfig`` (everything that defines the mechanism);
- ``dptrain.privacy.sampling``: counter-based Poisson sampling, ``shard_indices``;
- ``dptrain.privacy.noise``: counter-based Gaussian noise, ``secure_seed``;
- ``dptrain.privacy.accounting``: ``Ledger``, ``epsilon``, ``calibrate_noise_multiplier``,
  budget checks (opacus' PRV and RDP accountants).

Submodules are imported explicitly (this package imports nothing heavy, so loading the config
does not pull in torch or opacus). See docs/privacy.md.
"""
