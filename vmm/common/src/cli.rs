//! Command-line parsing shared by the workspace's clap binaries (`bounce-experiment`,
//! `bounce-replay`, `bouncevm-vhost`, `bouncevm-load`, `bouncevm-experiment`): a usage error is
//! one line and exit status 2.

/// A clap error as the one line the binaries print after `NAME: error: `: clap's message up
/// to its usage section, joined, without clap's own `error: ` prefix.
pub fn clap_error_line(e: &clap::Error) -> String {
    let text = e.to_string();
    let msg: Vec<&str> = text
        .lines()
        .map(str::trim)
        .take_while(|l| !l.is_empty() && !l.starts_with("Usage:"))
        .collect();
    let msg = msg.join(" ");
    msg.strip_prefix("error: ").unwrap_or(&msg).to_string()
}

/// Parses a binary's command line with clap: `--help`/`--version` print and exit 0; an error
/// prints `NAME: error: <one line><hint>` and exits 2. `Err` is the exit code to return from
/// `main`.
pub fn parse_args<C: clap::Parser>(name: &str, hint: &str) -> Result<C, std::process::ExitCode> {
    parse_args_from(name, hint, std::env::args_os())
}

/// As [`parse_args`] for the arguments `args` (the program name first).
///
/// # Errors
/// As [`parse_args`].
pub fn parse_args_from<C, I>(name: &str, hint: &str, args: I) -> Result<C, std::process::ExitCode>
where
    C: clap::Parser,
    I: IntoIterator<Item = std::ffi::OsString>,
{
    match C::try_parse_from(args) {
        Ok(c) => Ok(c),
        Err(e) if !e.use_stderr() => {
            // --help, --version
            let _ = e.print();
            Err(std::process::ExitCode::SUCCESS)
        }
        Err(e) => {
            eprintln!("{name}: error: {}{hint}", clap_error_line(&e));
            Err(std::process::ExitCode::from(2))
        }
    }
}
