//! What several of the bounce integration tests share.

/// One `#[test]` per `name: args;` line, each calling `$run(args)`: the allocator (and mode)
/// matrices of the stress and replay tests.
macro_rules! tests_of {
    ($run:ident { $($name:ident: $($arg:expr),+;)* }) => {$(
        #[test]
        fn $name() {
            $run($($arg),+);
        }
    )*};
}
