//! bouncevm's VMM side: the vhost-user server and shared command-line parsing.

#![warn(missing_docs)]

pub mod options;
pub mod vhost;
