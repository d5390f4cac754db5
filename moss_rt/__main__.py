from moss_rt.cli import main

raise SystemExit(main())
