from impasto.cli import main

raise SystemExit(main())
