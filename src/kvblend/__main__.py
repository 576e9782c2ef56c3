from kvblend.cli import main

raise SystemExit(main())
