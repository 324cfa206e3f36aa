"""The prompt cache on disk: the keys and values of prompt prefixes a run prefilled, kept in
mdcli's cache folder so a later run over the same document prefills only what is new.

* `key.py`: what an entry is keyed by (the namespace: the model's weights digest, config, dtype,
  device, kernel plan, versions) and the folder `--prompt-cache auto|off|DIR` names;
* `store.py`: `PromptStore`, the core's `PrefixStore` for one namespace: safetensors files with
  their token ids in the header, written atomically, checked on read, evicted least recently used;
* `listing.py`: `mdcli cache list` and `mdcli cache clear`.
"""
