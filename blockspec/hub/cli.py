"""`blockspec download MODEL [--draft D]`: fetch from the Hugging Face Hub, verify, summarize."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from blockspec.errors import ConfigError
from blockspec.hub.resolve import is_hub_id


def add_download_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "download", help="fetch a model (and its DFlash drafter) from the Hugging Face Hub, "
                         "verify the files, summarize the model")
    p.add_argument("model", metavar="MODEL", help="Hub id, org/name")
    p.add_argument("--draft", default=None, metavar="D", help="a DFlash drafter's Hub id too")
    p.add_argument("--revision", default=None, help="branch, tag or commit of MODEL (default: "
                                                    "main)")
    p.add_argument("--draft-revision", default=None, help="branch, tag or commit of --draft")
    p.add_argument("--local-dir", default=None, metavar="DIR",
                   help="put MODEL's files in DIR instead of the Hugging Face cache")
    p.add_argument("--draft-local-dir", default=None, metavar="DIR",
                   help="put the drafter's files in DIR instead of the Hugging Face cache")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="also fetch the repos' *.py files (remote code)")
    p.set_defaults(func=cmd_download)


def cmd_download(args: argparse.Namespace) -> int:
    from blockspec.hub.fetch import fetch
    from blockspec.hub.verify import verify_snapshot
    from blockspec.summary import summary_line

    jobs = [("model", args.model, args.revision, args.local_dir)]
    if args.draft is not None:
        jobs.append(("draft", args.draft, args.draft_revision, args.draft_local_dir))
    elif args.draft_revision or args.draft_local_dir:
        raise ConfigError("--draft-revision and --draft-local-dir need --draft")
    for what, name, _, _ in jobs:
        if not is_hub_id(name):
            raise ConfigError(f"{what} {name!r} is not a Hugging Face Hub id (org/name)")
    serve = ["blockspec", "serve"]
    paths: dict[str, str] = {}
    for what, name, revision, local_dir in jobs:
        try:
            snap = fetch(name, revision=revision, trust_remote_code=args.trust_remote_code,
                         local_dir=local_dir, what=what)
        except KeyboardInterrupt:
            print(f"\nblockspec: interrupted: the files of {name} completed so far are kept; "
                  "run the same command again to resume", file=sys.stderr)
            return 130
        check = verify_snapshot(snap)
        if check.problems:
            raise ConfigError(f"{what} {name!r} in {snap.path} fails verification: "
                              f"{'; '.join(check.problems[:3])} (delete those files and run "
                              "`blockspec download` again)")
        commit = f" @ {snap.commit[:12]}" if snap.commit else ""
        print(f"{what} {name}{commit}: {snap.path}")
        print("  " + (check.summary() if snap.files is not None
                      else "not verified: offline, and no cached listing of the repo"))
        print(f"  {summary_line(snap.path)}")
        paths[what] = snap.path
        if Path(name).exists() and local_dir is None:
            print(f"  note: a local folder {name!r} exists here and wins over the Hub id: serve "
                  "the path above", file=sys.stderr)
        serve += _serve_args(what, name, revision, local_dir)
    if args.trust_remote_code:
        serve.append("--trust-remote-code")
    print_inspect(paths["model"], paths.get("draft"))
    print("serve it with: " + shlex.join(serve))
    return 0


def print_inspect(model: str, draft: str | None) -> None:
    """`blockspec inspect`'s report of the downloaded pair on one H200, or why blockspec cannot
    serve it."""
    from blockspec.cli_inspect import render
    from blockspec.sizing.plan import inspect_drafter, inspect_model, plan_layout

    try:
        report = inspect_model(model)
        pair = inspect_drafter(draft, report) if draft else None
        sys.stdout.write(render(report, pair, plan_layout(report, pair, 1, 1, 141.0, 0.9, None)))
    except ConfigError as e:
        print(f"blockspec cannot serve it as it is: {e}")


def _serve_args(what: str, name: str, revision: str | None, local_dir: str | None) -> list[str]:
    """`blockspec serve`'s words for one downloaded repo: a local dir by its path; a Hub id as
    it is (it resolves from the cache, offline too)."""
    flag = [] if what == "model" else ["--draft"]
    if local_dir is not None:
        return flag + [local_dir]
    rev = [] if revision is None else ["--revision" if what == "model" else "--draft-revision",
                                       revision]
    return flag + [name] + rev
