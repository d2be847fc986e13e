from nanoeuler.cli import main

main()
