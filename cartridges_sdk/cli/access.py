"""Who may read what: ``keys`` (the per-user key file `cartridges serve --keys` reads) and ``forget`` (a document
deleted from a store with every file made from it)."""

from __future__ import annotations

import argparse
import sys

from ..errors import ConfigError
from ..serve.access import KeyFile
from . import common


def cmd_keys(args: argparse.Namespace) -> int:
    if args.action != "list" and not args.id:
        raise ConfigError(f"`cartridges keys {args.action}` needs the key's id, e.g. `cartridges keys {args.action} "
                          f"dr-ada --keys {args.keys}`.")
    if args.action in ("allow", "deny") and not args.names:
        raise ConfigError(f"`cartridges keys {args.action} {args.id}` needs the cartridge names (or patterns).")
    if args.allow and args.action != "add":
        raise ConfigError("--allow goes with `keys add`; to change a key's list use `keys allow ID NAME...`.")
    keys = KeyFile(args.keys, create=args.action == "add")
    if args.action == "add":
        key = keys.add(args.id, args.allow, args.rate)
        print(key)
        print(f"added key {args.id!r} opening {args.allow or 'nothing yet'} (rate {args.rate}); the key above is "
              "shown only now: give it to its owner", file=sys.stderr)
    elif args.action == "rotate":
        print(keys.rotate(args.id))
        print(f"rotated {args.id!r}: the old key no longer works; the new one above is shown only now",
              file=sys.stderr)
    elif args.action == "revoke":
        keys.revoke(args.id)
        print(f"revoked {args.id!r}", file=sys.stderr)
    elif args.action == "allow":
        keys.allow(args.id, args.names)
    elif args.action == "deny":
        keys.deny(args.id, args.names)
    if args.action in ("allow", "deny", "list"):
        for key_id, grant in keys.keys().items():
            if args.action == "list" or key_id == args.id:
                print(f"{key_id}\trate {grant.rate or 'none'}\tallow {', '.join(grant.allow) or '-'}")
    return 0


def cmd_forget(args: argparse.Namespace) -> int:
    from ..serve.store import CartridgeStore

    keys = KeyFile(args.keys) if args.keys else None  # checked before the model loads
    lm = common.model_for(args.model)
    try:
        removed = CartridgeStore(args.store, lm).forget(args.name, args.documents, timeout=args.wait)
    finally:
        lm.close()
    for path in removed:
        print(f"removed {path}")
    if keys is not None:
        for key_id in keys.forget(args.name):
            print(f"removed {args.name} from key {key_id}'s allow-list")
    if args.documents is None:
        print(f"note: the document {args.name!r} itself is kept wherever the store syncs from (a sync would build it "
              "again); pass --documents FOLDER to delete it too", file=sys.stderr)
    return 0
