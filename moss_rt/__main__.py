from moss_rt.cli import main

raise SystemExit(main(prog="python -m moss_rt"))
