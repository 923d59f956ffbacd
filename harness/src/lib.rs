pub mod checker;
pub mod client;
pub mod gateway;
pub mod history;
pub mod lazyfs;
pub mod pg;
pub mod proxy;
pub mod world;
