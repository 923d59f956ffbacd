pub mod checker;
pub mod client;
pub mod gateway;
pub mod history;
pub mod pg;
pub mod world;
