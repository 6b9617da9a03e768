"""One module per `switchyard` command, each with the same two entry points.

    add_parser(subparsers) -> None   add the command's parser (and its actions' parsers) to
                                     the top-level subparsers, and `set_defaults(run=run)`
                                     on the command's own parser
    run(args) -> int                 the command: its exit status

`cli.main` calls `add_parser` of each module in turn, then `args.run(args)`.
A command with actions (`models make-demo`, `bench engine`, `cascade train`) keeps an
`ACTIONS` table, action name -> `_cmd_<action>(args) -> int`, and its `run` looks up
`args.action` there (`args.target` for `bench`). `admin` is the exception: every action
is a call on one admin client, so its `run` opens the client and dispatches on
`(args.action, args.op)` itself.

Handlers import what they need inside their bodies, so `switchyard --help` stays fast.
"""
