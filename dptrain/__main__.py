from dptrain.cli import main

raise SystemExit(main())
