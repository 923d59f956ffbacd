pub mod gateway;
pub mod pg;
pub mod world;
pub mod client;
