//! Option values with one fixed name per variant: [`named_enum!`](crate::named_enum) writes
//! their `ALL`, `name`, `Display` and `FromStr` once, for the enums of this crate (allocator,
//! pool mode, copy rule) and of `devices` (cache mode, aio mode, on-full action, image format).

/// The names a parse error lists as expected: `a, b or c`.
pub fn or_list(names: &[&str]) -> String {
    match names {
        [] => String::new(),
        [one] => (*one).to_string(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
    }
}

/// The names a parse error lists as expected, for long lists: `one of: a, b, c`.
pub fn one_of_list(names: &[&str]) -> String {
    format!("one of: {}", names.join(", "))
}

/// Gives a fieldless enum its names: `ALL` (the variants in the order listed), `name()`,
/// `Display` (the name) and `FromStr` (the name back, or the error
/// `unknown WHAT 'VALUE' (expected LIST)`).
///
/// ```
/// #[derive(Clone, Copy, Debug, PartialEq, Eq)]
/// pub enum Colour {
///     /// Red.
///     Red,
///     /// Dark blue.
///     DarkBlue,
/// }
///
/// bounce::named_enum! {
///     Colour, "colour", err: String = String::from;
///     Red => "red",
///     DarkBlue => "dark-blue",
/// }
///
/// assert_eq!(Colour::DarkBlue.to_string(), "dark-blue");
/// assert_eq!("red".parse::<Colour>(), Ok(Colour::Red));
/// assert_eq!(
///     "blue".parse::<Colour>().unwrap_err(),
///     "unknown colour 'blue' (expected red or dark-blue)"
/// );
/// ```
///
/// `list: PATH` after the error picks how the expected names are listed (default
/// [`or_list`](crate::names::or_list); [`one_of_list`](crate::names::one_of_list) for long
/// lists).
#[macro_export]
macro_rules! named_enum {
    (
        $ty:ident, $what:literal, err: $err:ty = $make_err:expr;
        $($var:ident => $name:literal),+ $(,)?
    ) => {
        $crate::named_enum! {
            $ty, $what, err: $err = $make_err, list: $crate::names::or_list;
            $($var => $name),+
        }
    };
    (
        $ty:ident, $what:literal, err: $err:ty = $make_err:expr, list: $list:path;
        $($var:ident => $name:literal),+ $(,)?
    ) => {
        impl $ty {
            /// Every value, in the order of their names' table.
            pub const ALL: [$ty; [$($name),+].len()] = [$($ty::$var),+];

            /// The name on command lines, in options and in reports.
            pub const fn name(self) -> &'static str {
                match self {
                    $($ty::$var => $name),+
                }
            }
        }

        impl ::std::fmt::Display for $ty {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.name())
            }
        }

        impl ::std::str::FromStr for $ty {
            type Err = $err;
            fn from_str(s: &str) -> ::std::result::Result<Self, $err> {
                Self::ALL.into_iter().find(|v| v.name() == s).ok_or_else(|| {
                    let names = [$($name),+];
                    ($make_err)(format!("unknown {} '{s}' (expected {})", $what, $list(&names)))
                })
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Pick {
        First,
        SecondOne,
        Third,
    }

    crate::named_enum! {
        Pick, "pick", err: String = String::from;
        First => "first",
        SecondOne => "second-one",
        Third => "third",
    }

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Long {
        A,
        B,
    }

    crate::named_enum! {
        Long, "long", err: crate::Error = crate::Error::Config, list: one_of_list;
        A => "a",
        B => "b",
    }

    #[test]
    fn names_round_trip_and_errors_list_them() {
        assert_eq!(Pick::ALL, [Pick::First, Pick::SecondOne, Pick::Third]);
        for p in Pick::ALL {
            assert_eq!(p.to_string().parse::<Pick>(), Ok(p));
        }
        assert_eq!(Pick::SecondOne.name(), "second-one");
        assert_eq!(
            "Second-One".parse::<Pick>().unwrap_err(),
            "unknown pick 'Second-One' (expected first, second-one or third)"
        );
        assert_eq!(
            "c".parse::<Long>().unwrap_err().to_string(),
            crate::Error::Config("unknown long 'c' (expected one of: a, b)".into()).to_string()
        );
    }

    #[test]
    fn lists() {
        assert_eq!(or_list(&[]), "");
        assert_eq!(or_list(&["a"]), "a");
        assert_eq!(or_list(&["a", "b"]), "a or b");
        assert_eq!(or_list(&["a", "b", "c"]), "a, b or c");
        assert_eq!(one_of_list(&["a", "b", "c"]), "one of: a, b, c");
    }
}
